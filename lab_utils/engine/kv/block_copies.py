"""One block's K/V between the device cache and host memory, for the host tier (`host_tier.py`).

On a CPU the device and the host are the same memory: a copy is a plain synchronous copy.

On CUDA the host tier's copies live in pinned (page-locked) memory, so the card's copy engine can move them
without the CPU. A block going out (the device is about to reuse it) is copied synchronously: its bytes must
be out before new tokens overwrite it. A block coming back is copied on a side stream with `non_blocking=True`
(after the compute stream's work so far: the block's old contents may still be read there) and an event is
recorded after it, on which the compute stream waits at once: the device waits, not the host. The engine's
thread goes on (the rest of the prefix walk, the scheduling, the batch's inputs) while the copies run, and
whatever the compute stream does next (the forward, a swap's copy out, a block's copy out) comes after them.
"""
from __future__ import annotations

import torch

from lab_utils.engine.kv.kv_cache import KVCache

Saved = dict[str, torch.Tensor]


class BlockCopies:
    """`copy_out(block_id) -> Saved` and `copy_in(block_id, saved)` over one `KVCache`."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache
        self.device = kv_cache.k.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.async_copies_in = 0

    def _names(self) -> list[str]:
        return ["k", "v", "k_scale", "v_scale"] if self.kv.quantized else ["k", "v"]

    def copy_out(self, block_id: int) -> Saved:
        if not self.cuda:
            return self.kv.copy_out([block_id])
        s = self.kv._slots_of([block_id])
        saved = {}
        for name in self._names():
            rows = self.kv._raw(getattr(self.kv, name))[:, s]
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            saved[name] = host.copy_(rows)  # synchronous: the block is about to be overwritten
        return saved

    def copy_in(self, block_id: int, saved: Saved) -> None:
        if not self.cuda:
            self.kv.copy_in([block_id], saved)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the block's old contents may still be read or copied out there
        with torch.cuda.stream(self.stream):
            s = self.kv._slots_of([block_id])[:saved["k"].shape[1]]
            for name, t in saved.items():
                self.kv._raw(getattr(self.kv, name))[:, s] = t.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # a device-side wait: the host goes on
        self.async_copies_in += 1

    @staticmethod
    def pin(t: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory for a block read from disk: its copy to the card can then be asynchronous."""
        return t.pin_memory()
