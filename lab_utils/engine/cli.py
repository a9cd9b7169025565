"""`python -m lab_utils generate`, and the engine flags every engine command shares (bench, serve).

Flag names mirror vLLM's engine arguments (`--max-num-seqs`, `--enable-prefix-caching`, ...), so a command
line means the same thing against either engine. A flag left out keeps `EngineConfig`'s default.
"""
from __future__ import annotations

import argparse
import json
import math

from lab_utils.engine.config import (KV_CACHE_DTYPES, KV_OFFLOAD_POLICIES, PREEMPTION_MODES, SCHEDULERS, EngineConfig,
                                     attention_backend_names)

DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}

# (flag, EngineConfig field, argparse kwargs)
_ENGINE_FLAGS = [
    ("--scheduler", "scheduler", dict(choices=SCHEDULERS, help="batching policy (default token_budget)")),
    ("--max-num-seqs", "max_num_seqs", dict(type=int, help="most requests running at once (default 64)")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", dict(type=int, help="token budget of one step (default 512)")),
    ("--block-size", "block_size", dict(type=int, help="tokens per KV block (default 16)")),
    ("--num-gpu-blocks", "num_gpu_blocks", dict(type=int, help="KV pool size in blocks (default: from the memory budget)")),
    ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", dict(type=int, help="KV budget in bytes (default 1 GiB on CPU)")),
    ("--gpu-memory-utilization", "gpu_memory_utilization",
     dict(type=float, help="share of the GPU's total memory for weights + activations + KV (default 0.9, as vLLM)")),
    ("--max-model-len", "max_model_len", dict(type=int, help="longest prompt + output (default: the model's)")),
    ("--enable-prefix-caching", "enable_prefix_caching", dict(action=argparse.BooleanOptionalAction,
                                                              help="reuse KV blocks of shared prompt prefixes (default on)")),
    ("--enable-chunked-prefill", "enable_chunked_prefill", dict(action=argparse.BooleanOptionalAction,
                                                                help="split long prompts across steps (default on)")),
    ("--kv-cache-dtype", "kv_cache_dtype", dict(choices=KV_CACHE_DTYPES, help="KV storage type (default auto = model dtype)")),
    ("--quantization", "quantization", dict(choices=("int8", "int4", "w8a8", "w8a8-g32"),
                                               help="int8/int4 weights; w8a8: int8 activations too, a scale per "
                                                    "token (w8a8-g32: per 32 inputs) (default none)")),
    ("--kv-offloading-size", "kv_offload_bytes",
     dict(type=lambda gib: int(float(gib) * 2**30), metavar="GiB",
          help="host memory in GiB for KV blocks the prefix cache evicts, as vLLM (default off)")),
    ("--kv-offloading-policy", "kv_offload_policy",
     dict(choices=KV_OFFLOAD_POLICIES, help="which host-tier block goes first: lru, or 2q (keeps prefixes that came "
                                      "back before; default lru)")),
    ("--kv-offloading-disk-size", "kv_offload_disk_bytes",
     dict(type=lambda gib: int(float(gib) * 2**30), metavar="GiB",
          help="disk in GiB under the host tier for the blocks it drops, as vLLM's fs secondary tier; needs "
               "--kv-offloading-size (default off)")),
    ("--kv-offloading-disk-path", "kv_offload_disk_path",
     dict(metavar="DIR", help="where the disk tier makes its directory, removed at exit (default: the system's "
                              "temp dir)")),
    ("--preemption-mode", "preemption_mode", dict(choices=PREEMPTION_MODES, help="when KV runs out (default recompute)")),
    ("--enforce-eager", "enforce_eager", dict(action="store_true", default=None, help="never compile/capture graphs")),
    ("--attention-backend", "attention_backend",
     dict(choices=attention_backend_names, help="attention of a step: auto (flex on CUDA where it compiles, else "
                                                "sdpa) or a backend by name (default auto)")),
    ("--speculative-config", "speculative", dict(type=json.loads, metavar="JSON",
                                                 help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')),
]


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """Add `--model`, `--device`, `--dtype` and the engine flags (`EngineConfig` fields, vLLM names)."""
    if with_model:
        parser.add_argument("--model", default="smollm2-135m", help="model name or HF folder (default smollm2-135m)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default auto")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="default auto: fp32 on CPU, bf16 on GPU")
    g = parser.add_argument_group("engine (names as in vLLM)")
    for flag, _, kw in _ENGINE_FLAGS:
        if callable(kw.get("choices")):  # a list that lives elsewhere, read when a parser is built
            kw = {**kw, "choices": kw["choices"]()}
        g.add_argument(flag, **{"default": None, **kw})


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """EngineConfig from the flags that were given (invalid values raise ValueError naming the field)."""
    kw = {f: getattr(args, _dest(flag)) for flag, f, _ in _ENGINE_FLAGS if getattr(args, _dest(flag), None) is not None}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(**kw)


def torch_dtype(name: str | None):
    import torch

    resolved = DTYPES.get(name or "auto")
    return None if resolved is None else getattr(torch, resolved)


def build_engine(args: argparse.Namespace, **overrides):
    from lab_utils.engine.engine import LLMEngine

    return LLMEngine(args.model, engine_config_from_args(args, **overrides), device=args.device,
                     dtype=torch_dtype(args.dtype))


# --------------------------------------------------------------------------------------------- generate
def run_generate(args: argparse.Namespace) -> int:
    from lab_utils.engine.sampling_params import SamplingParams

    engine = build_engine(args)
    prompts = list(args.prompt)
    if args.chat:
        from lab_utils.models.tokenizer import chat_prompt

        prompts = [chat_prompt(engine.tokenizer, p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(args.prompt, outs):
        m = out.metrics
        tpot = m.tpot
        print(f"--- {prompt!r}")
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, TTFT {m.ttft * 1e3:.0f} ms, "
              f"TPOT {'-' if tpot is None else f'{tpot * 1e3:.0f} ms'}, E2E {m.e2e * 1e3:.0f} ms]")
    if engine.spec is not None:
        st = engine.stats()
        rate, per_step = st["spec_acceptance_rate"], st["spec_mean_tokens_per_step"]
        print(f"[speculative {engine.spec.config.method}: acceptance {'-' if rate is None else f'{rate:.2f}'}, "
              f"{'-' if per_step is None else f'{per_step:.2f}'} tokens per verify step]")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the lab engine")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def parse_rate(text: str) -> float:
    """A request rate: a positive number, or inf (everyone at t=0)."""
    rate = float(text)
    if not rate > 0 or math.isnan(rate):
        raise argparse.ArgumentTypeError(f"request rate {text!r} must be > 0 (or inf)")
    return rate
