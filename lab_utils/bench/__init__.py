"""Benchmarking the engine against baselines: workloads, metrics (vLLM `bench serve` names), backends, reports.

    python -m lab_utils bench --backend lab --scheduler continuous --num-prompts 32 --json out.json
"""
