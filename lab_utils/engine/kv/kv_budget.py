"""How much memory the KV cache gets on a GPU, the way vLLM decides it.

vLLM's `gpu_memory_utilization` is the share of the card's *total* memory this whole instance may use: weights,
activations (measured by a profile run with a full step's tokens) and KV cache. The KV cache gets what is left:

    kv = utilization x total - weights - activations

and it must fit in what is free right now: a second engine on the same card (another learner, the other
disaggregation worker, a vLLM server beside the lab's) then gets a clear error naming a utilization that fits,
instead of the first engine silently taking 90 % of whatever happened to be free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """What one engine's sizing needs to know, in bytes (from `measure` on CUDA; by hand in tests)."""

    total: int  # the card's memory
    free: int  # free now, after this engine's weights are loaded and its profile run is done
    weights: int  # this engine's parameters and buffers
    activations: int  # peak extra memory of one full step (the profile run)


def kv_cache_budget(mem: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV cache: `utilization` x total minus this instance's weights and activations (vLLM)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={utilization} is invalid: must be in (0, 1]")
    instance = int(mem.total * utilization)
    used = mem.weights + mem.activations
    kv = instance - used
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {instance / GiB:.2f} GiB of the "
            f"{mem.total / GiB:.1f} GiB card, but its weights ({mem.weights / GiB:.2f} GiB) and activations "
            f"({mem.activations / GiB:.2f} GiB) already take {used / GiB:.2f} GiB: no room for a KV cache; raise "
            f"gpu_memory_utilization or set kv_cache_memory_bytes")
    if kv > mem.free:
        fits = (mem.free + used) / mem.total
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for a {kv / GiB:.2f} GiB KV cache but only "
            f"{mem.free / GiB:.2f} GiB of the {mem.total / GiB:.1f} GiB card is free (another engine or process "
            f"holds the rest); lower gpu_memory_utilization to at most {int(fits * 100) / 100:.2f}, or set "
            f"kv_cache_memory_bytes")
    return kv


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def measure(model: torch.nn.Module, device: torch.device, num_tokens: int, num_rows: int) -> DeviceMemory:
    """Profile run on CUDA: one forward of `num_tokens` tokens and the lm head for `num_rows` rows; its peak
    allocation above the weights is the activation memory every step may need."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
        pos = torch.arange(num_tokens, device=device)[None]
        hidden = model.hidden_states(ids, pos)
        model.logits(hidden[0, :num_rows]).float()
        del hidden
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, weights=model_bytes(model), activations=activations)
