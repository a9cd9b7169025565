"""Where the KV memory goes: capacity arithmetic, and per-step snapshots of the block pool during a real run.

- `kv_capacity(model, kv_cache_dtype, memory_bytes)`: how many tokens and sequences a KV budget holds
  (bytes per token from `paging.bytes_per_token`: 2 x layers x kv_heads x head_dim x bytes per value, + int8 scales).
- `run_recording(engine, prompts, params)`: drives `engine.step()` like `generate`, and after every step records
  how many tokens the running sequences hold in KV against how many slots are allocated to them, plus (optionally)
  which request owns each physical block: the data behind the fragmentation figures and the pool heat-map.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from lab_utils.engine.kv.paging import KV_CACHE_DTYPES, bytes_per_token

_MODEL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _model_shape(model) -> dict:
    """(layers, kv_heads, head_dim) from a loaded model, a config object/dict, or a registry name."""
    if isinstance(model, str):
        from lab_utils.models.registry import lookup

        spec, folder = lookup(model)
        if spec is not None and spec.config is not None:
            cfg = dict(spec.config)
        else:
            cfg = json.loads((folder / "config.json").read_text())
    elif isinstance(model, dict):
        cfg = dict(model)
    else:
        c = getattr(model, "config", model)
        cfg = {k: getattr(c, k) for k in ("num_hidden_layers", "num_key_value_heads", "hidden_size",
                                          "num_attention_heads", "max_position_embeddings") if hasattr(c, k)}
        if getattr(c, "head_dim", None):
            cfg["head_dim"] = c.head_dim
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                head_dim=head_dim, max_model_len=cfg.get("max_position_embeddings"))


def kv_capacity(model, kv_cache_dtype: str = "fp16", memory_bytes: int = 1 << 30, block_size: int = 16,
                max_model_len: int | None = None, avg_seq_len: int | None = None) -> dict:
    """How much a KV budget holds. `kv_cache_dtype` in fp32/fp16/bf16/fp8/int8.

    Returns bytes per token and per block, whole blocks and tokens, sequences that fit when each reserves
    `max_model_len` (contiguous) and, given `avg_seq_len`, when each takes only the blocks it uses (paged)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: must be one of {tuple(KV_CACHE_DTYPES)}")
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} must be > 0")
    s = _model_shape(model)
    per_token = bytes_per_token(s["layers"], s["kv_heads"], s["head_dim"], KV_CACHE_DTYPES[kv_cache_dtype])
    blocks = memory_bytes // (per_token * block_size)
    tokens = blocks * block_size
    max_len = max_model_len or s["max_model_len"] or tokens
    out = dict(bytes_per_token=per_token, bytes_per_block=per_token * block_size, num_blocks=int(blocks),
               tokens=int(tokens), max_model_len=int(max_len),
               seqs_contiguous=int(tokens // max_len))  # each sequence reserves max_model_len slots
    if avg_seq_len:
        out["seqs_paged"] = int(blocks // -(-avg_seq_len // block_size))  # each takes ceil(len / B) blocks
    return out


@dataclass
class KVRecord:
    """The pool after one engine step."""

    step: int
    time: float
    num_running: int
    tokens: int  # tokens whose K/V the running sequences hold
    allocated_slots: int  # slots in the blocks allocated to them (paged: on demand; contiguous: max_model_len each)
    block_owner: list[int] | None = None  # per physical block: index of the request holding it, -1 if free
    block_fill: list[float] | None = None  # per physical block: share of its slots holding tokens

    @property
    def waste_slots(self) -> int:
        return self.allocated_slots - self.tokens


@dataclass
class RecordedRun:
    outputs: list
    records: list[KVRecord] = field(default_factory=list)  # one per step after which a request is still resident
    steps: int = 0  # engine steps run: one more than the records, since the last step leaves the pool empty

    def waste_fraction(self) -> float:
        """Share of allocated KV slots holding no token, summed over all steps (time-weighted by steps)."""
        alloc = sum(r.allocated_slots for r in self.records)
        return sum(r.waste_slots for r in self.records) / alloc if alloc else 0.0

    def utilization(self) -> float:
        return 1.0 - self.waste_fraction()

    def peak_running(self) -> int:
        return max((r.num_running for r in self.records), default=0)

    def mean_running(self) -> float:
        return sum(r.num_running for r in self.records) / len(self.records) if self.records else 0.0


def snapshot(engine, index_of: dict[str, int] | None = None, with_map: bool = False) -> KVRecord:
    running = [r for r in engine.scheduler.running if not r.status.done]
    bs = engine.block_size
    tokens = sum(r.num_computed_tokens for r in running)
    allocated = sum(len(r.block_table) for r in running) * bs
    owner = fill = None
    if with_map:
        owner = [-1] * engine.num_blocks
        fill = [0.0] * engine.num_blocks
        for r in running:
            who = index_of.get(r.request_id, -1) if index_of else -1
            for i, b in enumerate(r.block_table):
                owner[b] = who
                fill[b] = min(max(r.num_computed_tokens - i * bs, 0), bs) / bs
    return KVRecord(engine.num_steps, engine.step_log[-1]["end"] if engine.step_log else 0.0, len(running),
                    tokens, allocated, owner, fill)


def run_recording(engine, prompts, params, with_map: bool = False) -> RecordedRun:
    """`engine.generate(prompts, params)` that also records the KV pool after every step (outputs in order)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    index_of = {rid: i for i, rid in enumerate(ids)}
    done, run = {}, RecordedRun(outputs=[])
    while engine.has_unfinished() and len(done) < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in index_of:
                done[out.request_id] = out
        run.steps += 1
        if engine.scheduler.num_running:
            run.records.append(snapshot(engine, index_of, with_map))
    run.outputs = [done[i] for i in ids]
    return run
