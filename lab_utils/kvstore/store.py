"""The store: one process that holds KV blocks by name within a byte budget, served over a local socket.

Every engine process that uses it is a client (`KVStoreClient`): `put` a block's K/V under its name, `get` it
back, by value (bytes cross the socket both ways, and are counted on both sides). A block's name is not
enough to take it: its token ids travel with it and must match, so a name collision is a miss, never a wrong
hit (as in the engine's own prefix cache). Full, the store drops the least recently used blocks first.

Why a process of its own: the KV then outlives any one engine and is shared by all of them (Mooncake's store
runs as a service beside the inference workers). Mooncake's own store (`mooncake-transfer-engine` on PyPI) and
LMCache were tried here and do not run on a CPU-only machine: the first links the NVIDIA driver (libcuda.so.1)
and libibverbs, the second needs cupy-cuda13x, cuda-python, numpy <= 2.2.6 and transformers >= 5.4. This store is
small on purpose: one process, one lock, no replication, no disk, no RDMA; a block is copied, never mapped.
"""
from __future__ import annotations

import multiprocessing as mp
import secrets
import signal
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

Payload = dict[str, tuple[str, tuple[int, ...], bytes]]  # tensor name -> (dtype, shape, raw bytes)


def payload_bytes(payload: Payload) -> int:
    return sum(len(raw) for _, _, raw in payload.values())


@dataclass
class StoreStats:
    """What the store holds and what crossed it (blocks and bytes; in = clients -> store, out = store -> clients)."""
    capacity_bytes: int
    bytes_used: int = 0
    blocks: int = 0
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    dropped: int = 0  # blocks dropped to make room
    refused: int = 0  # blocks larger than the whole store


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    payload: Payload
    nbytes: int


class BlockStore:
    """The store's state (no locking: the server holds it under one lock)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0")
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.stats = StoreStats(capacity_bytes)

    def put(self, name: bytes, token_ids: tuple[int, ...], payload: Payload) -> bool:
        """Keep a block; False if it was already held (then it only counts as used) or is larger than the store."""
        s = self.stats
        held = self.entries.get(name)
        if held is not None and held.token_ids == token_ids:
            self.entries.move_to_end(name)
            return False
        nbytes = payload_bytes(payload)
        if nbytes > s.capacity_bytes:
            s.refused += 1
            return False
        self._drop(name)
        while s.bytes_used + nbytes > s.capacity_bytes:
            self._drop(next(iter(self.entries)))
            s.dropped += 1
        self.entries[name] = _Entry(tuple(token_ids), payload, nbytes)
        s.bytes_used += nbytes
        s.blocks = len(self.entries)
        s.puts += 1
        s.put_bytes += nbytes
        return True

    def get(self, name: bytes, token_ids: tuple[int, ...]) -> Payload | None:
        s = self.stats
        s.gets += 1
        e = self.entries.get(name)
        if e is None or e.token_ids != tuple(token_ids):
            return None
        self.entries.move_to_end(name)
        s.hits += 1
        s.get_bytes += e.nbytes
        return e.payload

    def has(self, name: bytes, token_ids: tuple[int, ...]) -> bool:
        e = self.entries.get(name)
        return e is not None and e.token_ids == tuple(token_ids)

    def _drop(self, name: bytes) -> None:
        e = self.entries.pop(name, None)
        if e is not None:
            self.stats.bytes_used -= e.nbytes
            self.stats.blocks = len(self.entries)


def _handle(store: BlockStore, lock: threading.Lock, conn: Connection) -> None:
    """One client's requests, in order, until it hangs up."""
    ops = {"put": store.put, "get": store.get, "has": store.has, "stats": lambda: vars(store.stats).copy()}
    try:
        while True:
            op, args = conn.recv()
            with lock:
                try:
                    reply: Any = ("ok", ops[op](*args))
                except Exception as e:  # a bad request fails that request, not the store
                    reply = ("error", f"{type(e).__name__}: {e}")
            conn.send(reply)
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


def _serve(address_out: Connection, authkey: bytes, capacity_bytes: int) -> None:
    """The store process: accept clients, one thread each, until the parent terminates it (SIGTERM closes the
    listener, which removes its socket file)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    store, lock = BlockStore(capacity_bytes), threading.Lock()
    with Listener(family="AF_UNIX", authkey=authkey) as listener:
        address_out.send(listener.address)
        address_out.close()
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError, mp.AuthenticationError):
                continue
            threading.Thread(target=_handle, args=(store, lock, conn), daemon=True).start()


@dataclass
class ClientStats:
    """One client's side of the traffic: bytes sent and received in payloads, and the time spent waiting."""
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict = field(default_factory=dict)


class KVStoreClient:
    """A connection to the store (one per process or thread; calls on one client are serialised)."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self.address, self._authkey = address, authkey
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.stats = ClientStats()

    def __getstate__(self) -> dict:  # travels to a worker process as an address and a key, not a socket
        return {"address": self.address, "_authkey": self._authkey}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["_authkey"])

    def _call(self, op: str, *args):
        with self._lock:
            if self._conn is None:
                self._conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
            t = time.perf_counter()
            self._conn.send((op, args))
            status, value = self._conn.recv()
            dt = time.perf_counter() - t
        s = self.stats
        s.seconds += dt
        s.calls += 1
        s.by_op[op] = s.by_op.get(op, 0.0) + dt
        if status != "ok":
            raise RuntimeError(f"the KV store refused {op}: {value}")
        return value

    def put(self, name: bytes, token_ids: tuple[int, ...], payload: Payload) -> bool:
        stored = self._call("put", name, tuple(token_ids), payload)
        self.stats.puts += 1
        self.stats.put_bytes += payload_bytes(payload)
        return stored

    def get(self, name: bytes, token_ids: tuple[int, ...]) -> Payload | None:
        payload = self._call("get", name, tuple(token_ids))
        self.stats.gets += 1
        if payload is not None:
            self.stats.hits += 1
            self.stats.get_bytes += payload_bytes(payload)
        return payload

    def has(self, name: bytes, token_ids: tuple[int, ...]) -> bool:
        return self._call("has", name, tuple(token_ids))

    def store_stats(self) -> StoreStats:
        return StoreStats(**self._call("stats"))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class KVStoreProcess:
    """Start the store in a process of its own; `client()` connects to it. A context manager: the process ends
    with the block (or at `close()`)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0: the store's host memory in bytes")
        ctx = mp.get_context("spawn")  # no fork of a process that runs PyTorch's threads
        self.authkey = secrets.token_bytes(16)
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(child, self.authkey, capacity_bytes), daemon=True,
                                   name="kv-store")
        self.process.start()
        child.close()
        if not parent.poll(60):
            self.close()
            raise RuntimeError("the KV store process did not start within 60 s")
        self.address = parent.recv()
        parent.close()

    def client(self) -> KVStoreClient:
        return KVStoreClient(self.address, self.authkey)

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(10)

    def __enter__(self) -> "KVStoreProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
