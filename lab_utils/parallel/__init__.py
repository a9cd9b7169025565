"""Real parallelism on one machine: tensor parallelism and pipeline parallelism of the lab's Llama across
processes with torch.distributed (gloo on CPU, NCCL on GPU).

    from lab_utils.parallel import run_parallel
    res = run_parallel("smollm2-135m", ["Hello"], max_tokens=16, mode="tp", world_size=2)
    res.token_ids, res.comm_share
"""
from lab_utils.parallel.comm import Comm, free_tcp_port, pick_backend
from lab_utils.parallel.launch import ParallelResult, run_parallel, stop_processes
from lab_utils.parallel.pipeline_parallel import PipelineStage
from lab_utils.parallel.tensor_parallel import (
           RowParallelLinear,
           shard_llama,
           split_sizes,
)

__all__ = ["Comm", "ParallelResult", "PipelineStage", "RowParallelLinear", "free_tcp_port", "pick_backend",
           "run_parallel", "shard_llama", "split_sizes", "stop_processes"]
