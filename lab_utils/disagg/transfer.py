"""Moving one request's prompt KV from the prefill worker to the decode worker, with bytes and time on record.

A transfer is one message on a pipe (a Unix socket pair between the two processes): a small pickled header
(request fields + name, dtype and shape of each tensor) followed by the raw tensor bytes, back to back. The KV of
a request is K and V for every layer and prompt token: 2 x layers x tokens x kv_heads x head_dim x dtype bytes
(SmolLM2-135M in fp32: 46 KB per token, so a 500-token prompt ships 23 MB).

The decode worker reads on its own thread, while its engine steps; `send_s` (the prefill side's write) still
includes any wait for that reader (back-pressure), `recv_s` is the read on the decode side.
"""
from __future__ import annotations

import pickle
import struct
import time
import warnings
from dataclasses import asdict, dataclass

import torch

_LEN = struct.Struct("<Q")


@dataclass
class TransferRecord:
    request_id: str
    num_tokens: int
    bytes: int = 0
    serialize_s: float = 0.0  # prefill side: KV out of the paged cache + packing
    send_s: float = 0.0  # prefill side: writing to the pipe (includes any wait for the decode side's reader)
    recv_s: float = 0.0  # decode side: reading the message
    load_s: float = 0.0  # decode side: unpacking (the copy into the paged cache happens at admission)
    sent_at: float = 0.0  # monotonic clock, shared by all processes of the machine
    received_at: float = 0.0

    @property
    def transfer_s(self) -> float:
        """Time the data path was busy: pack + write + read + unpack."""
        return self.serialize_s + self.send_s + self.recv_s + self.load_s

    def to_dict(self) -> dict:
        return asdict(self) | {"transfer_s": self.transfer_s}


def pack(meta: dict, tensors: dict[str, torch.Tensor]) -> bytearray:
    """Header + raw bytes of every tensor in one buffer (one copy of each tensor, no pickling of tensor data)."""
    raws = {k: t.detach().contiguous().cpu().view(torch.uint8).reshape(-1) for k, t in tensors.items()}
    specs = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), raws[k].numel()) for k, t in tensors.items()]
    header = pickle.dumps({"meta": meta, "tensors": specs}, protocol=pickle.HIGHEST_PROTOCOL)
    buf = bytearray(_LEN.size + len(header) + sum(r.numel() for r in raws.values()))
    _LEN.pack_into(buf, 0, len(header))
    off = _LEN.size
    buf[off:off + len(header)] = header
    off += len(header)
    for r in raws.values():
        n = r.numel()
        buf[off:off + n] = r.numpy().tobytes() if n else b""
        off += n
    return buf


def unpack(buf: bytes | bytearray) -> tuple[dict, dict[str, torch.Tensor]]:
    """The inverse of `pack`: (meta, tensors). Tensors view `buf` (no copy); callers copy them into the cache."""
    (hlen,) = _LEN.unpack_from(buf, 0)
    head = pickle.loads(bytes(buf[_LEN.size:_LEN.size + hlen]))
    off, out = _LEN.size + hlen, {}
    mv = memoryview(buf)
    for name, dtype, shape, n in head["tensors"]:
        with warnings.catch_warnings():  # a read-only buffer is fine: the tensors are only read
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(mv[off:off + n], dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
        off += n
    return head["meta"], out


class KVSender:
    """Prefill side of the channel."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, meta: dict, kv: dict[str, torch.Tensor], record: TransferRecord) -> TransferRecord:
        t0 = time.perf_counter()
        buf = pack(meta, kv)
        t1 = time.perf_counter()
        record.serialize_s += t1 - t0
        record.bytes = len(buf)
        record.sent_at = t1
        self.conn.send_bytes(buf)
        record.send_s = time.perf_counter() - t1
        return record


class KVReceiver:
    """Decode side of the channel."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> tuple[dict, dict[str, torch.Tensor], float, float]:
        """-> (meta, tensors, recv_s, load_s). Raises EOFError when the prefill side has gone."""
        self.conn.poll(None)  # wait for a message to start arriving: idle time is not transfer time
        t0 = time.perf_counter()
        buf = self.conn.recv_bytes()
        t1 = time.perf_counter()
        meta, kv = unpack(buf)
        return meta, kv, t1 - t0, time.perf_counter() - t1
