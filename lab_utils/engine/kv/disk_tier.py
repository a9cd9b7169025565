"""A disk tier under the host tier (vLLM's "fs" secondary tier under its CPU tier, LMCache's local disk).

The host tier is bounded by host memory; the blocks it drops to make room (its policy's victims) come here
instead of vanishing, so a conversation that returns after a long absence reads its prefix back from disk
rather than recomputing it. The tier is one preallocated file with a slot per block (`blocks.bin`, sparse until
written) inside a directory of its own, made under `root` (default: the system's temp dir) and removed by
`close`: bounded bytes, nothing left behind.

Entries are kept under the same chained-hash names as the device and the host tier, with their token ids (a
name with other tokens is a miss, never a wrong hit). The tier is exclusive like the host tier: a block read
back leaves it. When full, it drops its least recently written entry (LRU).

Reads and writes are positional (`os.pread` / `os.pwrite`), so a prefetch thread may read a slot it claimed
(`claim` takes the entry out of the index and keeps its slot reserved until `read_claimed` frees it) while the
engine's thread writes other slots. Every index change happens on the engine's thread.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch

from lab_utils.engine.kv.tier import Saved, tier_stats

ALIGN = 64  # each tensor of a slot starts at a multiple of this: any dtype can view its bytes


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one block sits in a slot: (name, dtype, shape, offset, nbytes)."""

    fields: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]
    slot_bytes: int

    @classmethod
    def of(cls, saved: Saved) -> "Layout":
        fields, offset = [], 0
        for name, t in saved.items():
            fields.append((name, t.dtype, tuple(t.shape), offset, t.nbytes))
            offset += -(-t.nbytes // ALIGN) * ALIGN
        return cls(tuple(fields), offset)

    def matches(self, saved: Saved) -> bool:
        return [(n, d, s) for n, d, s, _, _ in self.fields] == [(n, t.dtype, tuple(t.shape)) for n, t in saved.items()]

    def pack(self, saved: Saved) -> bytearray:
        buf = bytearray(self.slot_bytes)
        for name, _, _, offset, nbytes in self.fields:
            t = saved[name].detach().contiguous().reshape(-1)
            buf[offset:offset + nbytes] = t.view(torch.uint8).cpu().numpy().tobytes()
        return buf

    def unpack(self, raw: bytes) -> Saved:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return {name: flat[offset:offset + nbytes].view(dtype).reshape(shape).clone()
                for name, dtype, shape, offset, nbytes in self.fields}


@dataclass
class DiskEntry:
    token_ids: tuple[int, ...]
    slot: int
    nbytes: int  # the block's K/V bytes (a slot may be a little larger: alignment)


class DiskTier:
    """Blocks the host tier dropped, by name, within `capacity_bytes` of one file under `root`."""

    def __init__(self, capacity_bytes: int, root: str | os.PathLike | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        if root is not None:
            os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="lab-kv-disk-", dir=root)
        self.path = os.path.join(self.dir, "blocks.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        # the file and its directory go at `close`, when the tier is collected, or at exit, whichever is first
        self._cleanup = weakref.finalize(self, _remove_files, self.fd, self.dir)
        self.layout: Layout | None = None  # learnt from the first block: every block of an engine has the same
        self.num_slots = 0
        self.free_slots: list[int] = []
        self.entries: OrderedDict[Hashable, DiskEntry] = OrderedDict()  # least recently written first
        self.claimed = 0  # slots a prefetch is reading
        self._lock = threading.Lock()  # guards free_slots, claimed and the read counters (the prefetch thread's)
        self.closed = False
        # counters: out = host -> disk, in = disk -> host or device
        self.hits = self.blocks_out = self.bytes_written = self.blocks_in = self.bytes_read = 0
        self.dropped = 0
        self.write_seconds = self.read_seconds = 0.0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: Hashable) -> bool:
        return name in self.entries

    @property
    def bytes_used(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def holds(self, name: Hashable, token_ids: tuple[int, ...]) -> bool:
        e = self.entries.get(name)
        return e is not None and e.token_ids == token_ids

    def put(self, name: Hashable, token_ids: tuple[int, ...], saved: Saved) -> bool:
        """Write one block under `name`, dropping the least recently written entries until a slot is free.
        False (not kept) if its slot is larger than the whole tier."""
        self._remove(name)
        if self.layout is None:
            self._open(Layout.of(saved))
        if not self.layout.matches(saved):
            raise ValueError(f"the disk tier holds blocks of layout {self.layout.fields}; this block differs: "
                             f"{[(n, t.dtype, tuple(t.shape)) for n, t in saved.items()]}")
        if self.num_slots == 0:
            return False
        while True:
            with self._lock:
                slot = self.free_slots.pop() if self.free_slots else None
            if slot is not None:
                break
            if not self.entries:  # every slot is being read by a prefetch: keep nothing rather than wait
                return False
            self._remove(next(iter(self.entries)))
            self.dropped += 1
        t0 = time.perf_counter()
        os.pwrite(self.fd, self.layout.pack(saved), slot * self.layout.slot_bytes)
        self.write_seconds += time.perf_counter() - t0
        nbytes = sum(t.nbytes for t in saved.values())
        self.entries[name] = DiskEntry(token_ids, slot, nbytes)
        self.blocks_out += 1
        self.bytes_written += nbytes
        return True

    def take(self, name: Hashable, token_ids: tuple[int, ...]) -> Saved | None:
        """A lookup's hit leaves the tier: its K/V read back, or None if the tier does not hold it."""
        entry = self.claim(name, token_ids)
        if entry is None:
            return None
        self.hits += 1
        return self.read_claimed(entry)

    def claim(self, name: Hashable, token_ids: tuple[int, ...]) -> DiskEntry | None:
        """Take `name` out of the index, its slot reserved until `read_claimed` (a prefetch reads it later)."""
        if not self.holds(name, token_ids):
            return None
        entry = self.entries.pop(name)
        with self._lock:
            self.claimed += 1
        return entry

    def read_claimed(self, entry: DiskEntry) -> Saved:
        """Read a claimed entry's K/V and free its slot. Safe on any thread."""
        t0 = time.perf_counter()
        raw = os.pread(self.fd, self.layout.slot_bytes, entry.slot * self.layout.slot_bytes)
        saved = self.layout.unpack(raw)
        with self._lock:
            self.read_seconds += time.perf_counter() - t0
            self.blocks_in += 1
            self.bytes_read += entry.nbytes
            self.claimed -= 1
            self.free_slots.append(entry.slot)
        return saved

    def _remove(self, name: Hashable) -> None:
        e = self.entries.pop(name, None)
        if e is not None:
            with self._lock:
                self.free_slots.append(e.slot)

    def _open(self, layout: Layout) -> None:
        self.layout = layout
        self.num_slots = self.capacity_bytes // layout.slot_bytes
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        os.ftruncate(self.fd, self.num_slots * layout.slot_bytes)  # sparse: disk is used as slots are written

    def books(self) -> str:
        """'' when the tier's books are right: every slot free, held or being read, within capacity."""
        with self._lock:
            free, claimed = len(self.free_slots), self.claimed
        held = {e.slot for e in self.entries.values()}
        if len(held) != len(self.entries) or len(held) + free + claimed != self.num_slots:
            return (f"disk tier: {len(self.entries)} entries in {len(held)} slots, {free} free, {claimed} being "
                    f"read, of {self.num_slots}")
        if self.layout is not None and self.num_slots * self.layout.slot_bytes > self.capacity_bytes:
            return f"disk tier: {self.num_slots} slots exceed {self.capacity_bytes} bytes"
        return ""

    def close(self) -> None:
        """Remove the tier's file and directory (the engine's close calls this)."""
        if self.closed:
            return
        self.closed = True
        self.entries.clear()
        self._cleanup()

    def stats(self) -> dict[str, float]:
        return tier_stats("disk", hits=self.hits, blocks_in=self.blocks_in, bytes_in=self.bytes_read,
                          seconds_in=self.read_seconds, blocks_out=self.blocks_out, bytes_out=self.bytes_written,
                          seconds_out=self.write_seconds, entries=len(self.entries), bytes=self.bytes_used,
                          capacity_bytes=self.capacity_bytes, dropped=self.dropped)


def _remove_files(fd: int, directory: str) -> None:
    os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)
