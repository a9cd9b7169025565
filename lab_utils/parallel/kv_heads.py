"""How tensor parallelism places attention heads, by vLLM's rules and by this course's, and what that does to the
KV cache's capacity.

vLLM shards attention by whole heads. It refuses a TP size that does not divide the query heads
(`ModelConfig.verify_with_parallel_config`, `vllm/config/model.py`: "Total number of attention heads (9) must be
divisible by tensor parallel size (2)"), and its fused q/k/v layer (`QKVParallelLinear`,
`vllm/model_executor/layers/linear.py`) either splits the KV heads evenly (TP divides them) or **replicates**
them (TP a multiple of them: every rank keeps one KV head, TP / KV-heads ranks keep the same one; the rank's count
is `ModelConfig.get_num_kv_heads`: max(1, KV heads // TP)). Anything else is refused. The course's own split
(`tensor_parallel.py`) accepts uneven counts instead, 3 KV heads over 2 ranks as 2 + 1.

Either way each rank stores the KV of its own KV heads for every token, so the rank holding the most KV heads
fills first. With replication a token's KV is stored TP / KV-heads times over: past TP = KV heads a wider group
adds memory, but every rank still pays one whole KV head per token. `kv_replication` is that factor, and
`kv_capacity_tokens` the capacity formula that counts it.
"""
from __future__ import annotations

import math


def _positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: must be an int >= 1")


def vllm_tp_refusal(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why vLLM refuses `tensor_parallel_size=tp` for a model with these head counts, or None if it accepts it."""
    _positive(num_heads=num_heads, num_kv_heads=num_kv_heads, tp=tp)
    if num_heads % tp:
        return (f"vLLM needs the attention heads divisible by tensor_parallel_size: {num_heads} heads are not "
                f"divisible by {tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"vLLM needs the KV heads divisible by tensor_parallel_size, or tensor_parallel_size a multiple of "
                f"them (replication): {num_kv_heads} KV heads and {tp} ranks are neither")
    return None


def check_vllm_tp(num_heads: int, num_kv_heads: int, tp: int, model: str = "the model") -> None:
    """Raise ValueError naming the head counts when vLLM would refuse `tensor_parallel_size=tp` for `model`."""
    why = vllm_tp_refusal(num_heads, num_kv_heads, tp)
    if why:
        ok = [n for n in range(1, num_heads + 1) if vllm_tp_refusal(num_heads, num_kv_heads, n) is None]
        raise ValueError(f"{model} cannot run with tensor_parallel_size={tp} in vLLM: {why}. Sizes vLLM accepts "
                         f"for it: {ok}; or pick a model whose heads divide {tp} (e.g. llama-3.2-1b-random: 32 "
                         f"heads, 8 KV heads)")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads the busiest rank holds: KV heads / TP when TP divides them, 1 when TP exceeds them (vLLM's
    max(1, KV heads // TP), replicated), ceil(KV heads / TP) for the course's uneven split."""
    _positive(num_kv_heads=num_kv_heads, tp=tp)
    return max(1, math.ceil(num_kv_heads / tp))


def kv_replication(num_kv_heads: int, tp: int) -> float:
    """How many times over the ranks together store each KV head, for the busiest rank's load: TP x (its KV heads)
    / KV heads. 1.0 for an even split; TP / KV heads with replication; above 1 for an uneven split."""
    return tp * kv_heads_per_rank(num_kv_heads, tp) / num_kv_heads


def kv_capacity_tokens(weight_bytes: float, kv_bytes_per_token: int, mem_bytes_per_gpu: float, tp: int,
                       gpu_memory_utilization: float, num_kv_heads: int) -> int:
    """KV tokens a TP group holds: each rank gets memory x utilization, minus its 1/TP of the weights, and stores
    its own KV heads' share of every token; the busiest rank decides. With an even split this is
    floor((TP·M·u − W) / bytes per token); replication divides it by `kv_replication`. 0 when the weights do not
    fit."""
    _positive(tp=tp, num_kv_heads=num_kv_heads)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is invalid: must be in (0, 1]")
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token={kv_bytes_per_token} is invalid: must be > 0")
    free = tp * mem_bytes_per_gpu * gpu_memory_utilization - weight_bytes
    if free <= 0:
        return 0
    stored_heads = tp * kv_heads_per_rank(num_kv_heads, tp)  # KV heads the group stores, replicas counted
    if stored_heads == num_kv_heads:  # an even split: the plain formula, in the same arithmetic
        return int(free // kv_bytes_per_token)
    return int(free * num_kv_heads // (kv_bytes_per_token * stored_heads))


__all__ = ["check_vllm_tp", "kv_capacity_tokens", "kv_heads_per_rank", "kv_replication", "vllm_tp_refusal"]
