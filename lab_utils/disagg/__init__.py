"""Prefill/decode disaggregation with real processes: a prefill worker, a decode worker, a router, and the KV of
every request shipped between them.

    from lab_utils.disagg import DisaggregatedCluster, colocated_run
    with DisaggregatedCluster("smollm2-135m", EngineConfig(...)) as cluster:
        outs = cluster.generate(prompts, SamplingParams(max_tokens=32), arrival_times=[...])
        cluster.transfer_stats()

`kv_transfer="store"`: the prompts' full KV blocks go through a shared KV store process instead of the pipe
between the workers (`store_handoff.py`; `cluster.worker_stats()` says what each worker still holds).
"""
from lab_utils.disagg.router import DisaggregatedCluster, WorkerFailure, colocated_run
from lab_utils.disagg.transfer import TransferRecord, pack, unpack
from lab_utils.disagg.workers import admit_prefilled, export_prompt_kv

__all__ = ["DisaggregatedCluster", "TransferRecord", "WorkerFailure", "admit_prefilled", "colocated_run",
           "export_prompt_kv", "pack", "unpack"]
