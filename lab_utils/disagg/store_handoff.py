"""The hand-off through the shared KV store (`DisaggregatedCluster(kv_transfer="store")`), Mooncake's layout.

Prefill side (`publish_prompt_kv`): the prompt's KV, as `export_kv` gives it ([layers, tokens, ...] per cache
tensor), is cut into the prompt's full blocks; each goes to the store under its stable name
(`lab_utils.kvstore.tier.stable_names`, equal in every process), unless the store holds it already (a prefix that
another request or worker published). The pipe then carries only the request's header (its metadata, first
token, the block names and the block size they were cut with) and the KV of the tokens after the named blocks: the
last, partial block, which has no name.

Decode side (`fetch_prompt_kv`): the blocks come back from the store by name and token ids, are put together with
the tail in token order, and the request is admitted as on the pipe path (`admit_prefilled`, with the learner's
`resume_prefilled` and `import_kv` where they run): the decode worker's cache holds exactly the prefill worker's KV.

Nothing is lost when the store lets a block go (dropped to make room for newer blocks, or the store gone): the
decode worker admits the request to be recomputed there (`admit_to_recompute`: its prompt and first token
prefilled again, as after a recompute preemption, then decoded as usual). A block the store refuses (larger than
the whole store) and every block after it travel on the pipe instead.
"""
from __future__ import annotations

import time

import torch

from lab_utils.engine.request import Request
from lab_utils.kvstore.store import KVStoreClient, payload_bytes
from lab_utils.kvstore.tier import decode, encode, stable_names

NAMES_KEY, BLOCK_SIZE_KEY = "kv_store_names", "kv_store_block_size"
_STORE_ERRORS = (OSError, EOFError, RuntimeError)  # the store process gone, or a request it refused


def publish_prompt_kv(client: KVStoreClient, kv: dict[str, torch.Tensor], token_ids: list[int],
                      block_size: int) -> tuple[list[bytes], dict[str, torch.Tensor], dict]:
    """Put the full blocks of a prompt's KV (`kv`: [layers, len(token_ids), ...] per tensor) in the store.
    Returns the names of the blocks the store holds now (a prefix of the prompt's blocks, in order), the KV of
    the tokens after them (for the pipe), and the prefill side's record: blocks put, blocks the store held
    already, payload bytes put, seconds spent cutting and putting them (`store_put_error` when the store
    failed)."""
    names = stable_names(list(token_ids), block_size)
    held: list[bytes] = []
    rec = {"store_blocks_put": 0, "store_blocks_held": 0, "store_put_bytes": 0, "store_put_s": 0.0}
    t0 = time.perf_counter()
    try:
        for i, name in enumerate(names):
            toks = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if client.has(name, toks):
                rec["store_blocks_held"] += 1
            else:
                payload = encode({n: t[:, i * block_size:(i + 1) * block_size] for n, t in kv.items()})
                if client.put(name, toks, payload):
                    rec["store_blocks_put"] += 1
                    rec["store_put_bytes"] += payload_bytes(payload)
                elif not client.has(name, toks):  # refused: larger than the whole store
                    break
            held.append(name)
    except _STORE_ERRORS as e:  # what the store took stays valid; the rest goes on the pipe
        rec["store_put_error"] = f"{type(e).__name__}: {e}"
    rec["store_put_s"] = time.perf_counter() - t0
    start = len(held) * block_size
    return held, {n: t[:, start:] for n, t in kv.items()}, rec


def fetch_prompt_kv(client: KVStoreClient, names: list[bytes], token_ids: list[int], block_size: int,
                    tail: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor] | None, dict]:
    """The prompt's KV in token order ([layers, tokens, ...] per tensor): the named blocks from the store, then
    `tail`. None when a block is missing (it stops at the first one: the request is recomputed, the rest is not
    fetched). Also the decode side's record: blocks got and missing, payload bytes got, and the seconds spent
    getting them and putting the prompt's KV together (`store_get_error` when the store failed)."""
    rec = {"store_blocks_got": 0, "store_blocks_missing": 0, "store_get_bytes": 0, "store_get_s": 0.0}
    blocks = []
    t0 = time.perf_counter()
    try:
        for i, name in enumerate(names):
            payload = client.get(name, tuple(token_ids[i * block_size:(i + 1) * block_size]))
            if payload is None:
                break
            blocks.append(decode(payload))
            rec["store_blocks_got"] += 1
            rec["store_get_bytes"] += payload_bytes(payload)
    except _STORE_ERRORS as e:
        rec["store_get_error"] = f"{type(e).__name__}: {e}"
    kv = None
    if len(blocks) < len(names):
        rec["store_blocks_missing"] = len(names) - len(blocks)
    else:
        try:  # blocks of another shape (a store shared with another model's workers) are recomputed too
            kv = {n: torch.cat([b[n] for b in blocks] + [t], dim=1) for n, t in tail.items()} if blocks else tail
        except (RuntimeError, KeyError) as e:
            rec["store_get_error"] = f"{type(e).__name__}: {e}"
    rec["store_get_s"] = time.perf_counter() - t0
    return kv, rec


def admit_to_recompute(engine, meta: dict) -> str:
    """Queue a handed-off request whose KV did not arrive: its prompt and first token are prefilled again here
    (status WAITING with nothing computed, as after a recompute preemption; a prefix cache may serve part of it),
    then it decodes as usual. Its first token and timestamps are the prefill worker's, as on the KV path."""
    req = Request(meta["request_id"], None, meta["prompt_token_ids"], meta["params"], meta["arrival_time"])
    req.token_ids.append(meta["first_token"])
    m = req.metrics
    m.first_scheduled_time, m.first_token_time = meta["first_scheduled_time"], meta["first_token_time"]
    m.token_times = [meta["first_token_time"]]
    req.num_cached_tokens = meta.get("num_cached_tokens", 0)
    return engine.admit(req)


def read_from_store(engine, client: KVStoreClient):
    """Put the store under the prefill worker's prefix cache (reading only: the hand-off publishes), so a prompt
    whose prefix another worker or request published skips computing it. None where that cannot be: the prefix
    cache is off, or the engine runs the learner's prefix-cache parts (`lab_utils.kvstore.tier.attach`)."""
    from lab_utils.kvstore.tier import attach

    try:
        return attach(engine, client)
    except ValueError:
        return None


def worker_report(engine, client: KVStoreClient | None, reads_store: bool = False) -> dict:
    """A worker's blocks (referenced ones are held by a request; none once everything has ended) and its side
    of the store traffic."""
    bm = engine.block_manager
    out = {"num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
           "referenced_blocks": sum(1 for b in bm.blocks if b.ref_count != 0),
           "unfinished_requests": sum(1 for r in engine.requests.values() if not r.status.done),
           "reads_store": reads_store}
    if client is not None:
        s = client.stats
        out.update(store_puts=s.puts, store_put_bytes=s.put_bytes, store_gets=s.gets, store_hits=s.hits,
                   store_get_bytes=s.get_bytes, store_seconds=s.seconds, store_calls=s.calls)
    return out
