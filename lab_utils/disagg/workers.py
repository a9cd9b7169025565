"""The two worker processes of a disaggregated deployment (DistServe / Splitwise / vLLM's P/D connectors).

- Prefill worker: an `LLMEngine` that only ever runs prompts. When a request has its first token, its prompt KV
  is copied out of the paged cache, shipped to the decode worker (`transfer.py`) and the request is dropped
  here. A request that ends with its first token (EOS, max_tokens=1) is answered directly.
- Decode worker: an `LLMEngine` doing continuous batching of decodes, with a reader thread that takes transfers
  off the channel while the engine steps. A request arrives with its KV, its first
  token and its timestamps; to the engine it is exactly a swapped-out request coming back (status SWAPPED,
  `swapped_kv` = the transferred KV): the scheduler admits it when blocks are free and swap-in copies the KV
  into the paged cache. So the engine needs no change to accept KV computed elsewhere.
Both report to the router over their own pipe; a dead worker shows as EOF there.

With a KV store (`store_client`, `DisaggregatedCluster(kv_transfer="store")`) the prompt's full blocks go through
the store instead of the pipe (`store_handoff.py`); the header and the last, partial block still take the pipe.
"""
from __future__ import annotations

import functools
import multiprocessing
import queue as queue_mod
import threading
import time
import traceback

import torch

from lab_utils.device import now
from lab_utils.disagg.transfer import KVReceiver, KVSender, TransferRecord
from lab_utils.engine.kv.paging import slot
from lab_utils.engine.request import Request, Status

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(model: str, config, device: str, dtype: str, extra_eos: set[int], parts=None):
    """An engine around the model, without a tokenizer (workers see token ids only; the router has the text);
    `parts`: the learner's engine parts (`learner_parts.parts`), None for the reference."""
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.parallel.runner import load_weights_only

    weights = load_weights_only(model, torch.device(device), DTYPES[dtype])
    engine = LLMEngine((weights, None), config, device=device, parts=parts)
    engine.eos_ids |= set(extra_eos)  # the tokenizer's EOS, which the colocated engine also stops on
    engine.keep_history = False  # a worker lives as long as the cluster: forget ended requests
    return engine


EXPORT_PART, IMPORT_PART, RESUME_PART = "disagg.export_kv", "disagg.import_kv", "disagg.resume_prefilled"
META_PART = "disagg.request_meta"
META_KEYS = ("request_id", "prompt_token_ids", "params", "arrival_time", "first_token", "first_token_time",
             "first_scheduled_time", "num_cached_tokens")


def request_meta(req: Request) -> dict:
    """What travels with the KV (the header of the transfer): who the request is, what it asked for (its prompt
    and sampling params: max_tokens, temperature, stop), the token the prefill side sampled, and the timestamps
    that make its TTFT, so the decode side can continue it and report it as if it had run there."""
    m = req.metrics
    return {"request_id": req.request_id, "prompt_token_ids": list(req.prompt_token_ids), "params": req.params,
            "arrival_time": m.arrival_time, "first_token": req.token_ids[-1], "first_token_time": m.first_token_time,
            "first_scheduled_time": m.first_scheduled_time, "num_cached_tokens": req.num_cached_tokens}


def _slots(block_table: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    return torch.tensor([slot(block_table, t, block_size) for t in range(num_tokens)], dtype=torch.long, device=device)


def export_kv(cache: dict[str, torch.Tensor], block_table: list[int], num_tokens: int,
              block_size: int) -> dict[str, torch.Tensor]:
    """What the prefill side sends: for every cache tensor ([layers, slots, ...]: k, v and, with an int8 cache,
    their scales), the entries of the request's first `num_tokens` tokens in token order, [layers, num_tokens, ...],
    on the CPU. Token t sits at slot block_table[t // block_size] * block_size + t % block_size."""
    out = {}
    for name, t in cache.items():
        out[name] = t[:, _slots(block_table, num_tokens, block_size, t.device)].cpu()
    return out


def import_kv(cache: dict[str, torch.Tensor], block_table: list[int], kv: dict[str, torch.Tensor],
              block_size: int) -> None:
    """The decode side's copy of received KV ([layers, n, ...] per tensor, token order) into its own blocks
    (`block_table`, allocated by its scheduler): token t goes to slot block_table[t // bs] * bs + t % bs."""
    for name, t in kv.items():
        cache[name][:, _slots(block_table, t.shape[1], block_size, cache[name].device)] = t.to(cache[name].device)


def resume_prefilled(req: Request, first_token: int, kv: dict[str, torch.Tensor]) -> None:
    """Make a fresh request (prompt only) the one the prefill worker ended with: its first token appended, its
    prompt counted as computed (the KV is in `kv`, not in a block yet), and to the scheduler a swapped-out
    request, so admitting it allocates blocks and swaps `kv` in (`import_kv`) instead of recomputing the prompt."""
    req.token_ids.append(first_token)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status, req.swapped_kv = Status.SWAPPED, kv


def kv_cache_tensors(kv_cache) -> dict[str, torch.Tensor]:
    """The paged cache's tensors by name, [layers, slots, ...] (fp8 viewed as bytes): what export/import index."""
    names = ["k", "v"] + (["k_scale", "v_scale"] if kv_cache.quantized else [])
    return {n: kv_cache._raw(getattr(kv_cache, n)) for n in names}


def kv_block_digests(cache: dict[str, torch.Tensor], block_table: list[int], num_tokens: int,
                     block_size: int) -> list[str]:
    """A fingerprint of each of a request's KV blocks as the paged cache holds it: for block i, a hash of the bytes
    of every cache tensor (k, v, int8 scales) at its tokens i * block_size ... in token order, read with the slot
    formula of the reference (not a part under test). Equal lists on both sides of a hand-off mean the decode
    worker's blocks hold exactly the prefill worker's KV, block by block; a block in the wrong place, a token in
    the wrong slot or a block never written (stale) changes its entry. Greedy tokens alone cannot show this: once
    RoPE is in K, attention does not depend on the order of the (K, V) pairs."""
    import hashlib

    slots = _slots(block_table, num_tokens, block_size, "cpu")
    out = []
    for start in range(0, num_tokens, block_size):
        h = hashlib.blake2b(digest_size=8)
        for name in sorted(cache):
            t = cache[name]
            h.update(t[:, slots[start:start + block_size].to(t.device)].contiguous().cpu().view(torch.uint8)
                     .numpy().tobytes())
        out.append(h.hexdigest())
    return out


def audit_swap_in(engine, audits: dict[str, list[str]]) -> None:
    """Wrap the decode engine's swap-in so that, right after a request's received KV is written into its blocks,
    the blocks' digests (`kv_block_digests`) are recorded in `audits` (the first swap-in of each request)."""
    inner = engine.scheduler.swap_in

    def swap_in(req: Request) -> None:
        inner(req)
        if req.request_id not in audits:
            audits[req.request_id] = kv_block_digests(kv_cache_tensors(engine.kv_cache), list(req.block_table),
                                                      req.num_prompt_tokens, engine.kv_cache.block_size)

    engine.scheduler.swap_in = swap_in


def load_disagg_parts(names=()) -> tuple[dict, list[str]]:
    """{part: function} for the three hand-off parts (the learner's saved version for those in `names`, loaded
    from my_engine/ in this worker process; errors name the part), and the names of the learner's."""
    from lab_utils.course import learner_parts

    refs = {EXPORT_PART: export_kv, IMPORT_PART: import_kv, RESUME_PART: resume_prefilled, META_PART: request_meta}
    return learner_parts.saved_parts(names, refs, "KV hand-off")


def export_prompt_kv(engine, req: Request, export_fn=export_kv) -> dict[str, torch.Tensor]:
    """K/V of the request's prompt tokens, [layers, tokens, kv_heads, head_dim] each (+ int8 scales)."""
    from lab_utils.course.parts import LearnerPartError

    cache = kv_cache_tensors(engine.kv_cache)
    kv = export_fn(cache, list(req.block_table), req.num_prompt_tokens, engine.kv_cache.block_size)
    want = {n: (t.shape[0], req.num_prompt_tokens, *t.shape[2:]) for n, t in cache.items()}
    got = {n: tuple(t.shape) for n, t in kv.items()} if isinstance(kv, dict) else kv
    if got != want:
        raise LearnerPartError(f"your {EXPORT_PART} returned {got} for a {req.num_prompt_tokens}-token prompt; the "
                               f"decode side needs {want} (every cache tensor, the prompt's tokens only)")
    return kv


def prompt_meta(req: Request, meta_fn=request_meta) -> dict:
    """The transfer's header for `req`, from `meta_fn`; one that lacks a field the decode side reads says so."""
    from lab_utils.course.parts import LearnerPartError

    meta = meta_fn(req)
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise LearnerPartError(f"your {META_PART} sent no {missing}: the decode side needs every one of {META_KEYS}")
    return meta


def swap_in_with(import_fn, kv_cache, req: Request) -> None:
    """The scheduler's swap-in through `import_fn` (the decode worker's admission of transferred KV)."""
    import_fn(kv_cache_tensors(kv_cache), list(req.block_table), req.swapped_kv, kv_cache.block_size)
    req.swapped_kv = None


def admit_prefilled(engine, meta: dict, kv: dict[str, torch.Tensor], resume_fn=resume_prefilled) -> str:
    """Queue a request whose prompt KV and first token were computed elsewhere (see the module doc)."""
    from lab_utils.course.parts import LearnerPartError

    req = Request(meta["request_id"], None, meta["prompt_token_ids"], meta["params"], meta["arrival_time"])
    resume_fn(req, meta["first_token"], kv)
    P = req.num_prompt_tokens
    state = (req.num_tokens, req.num_computed_tokens, req.status, req.swapped_kv is kv)
    if state != (P + 1, P, Status.SWAPPED, True):
        raise LearnerPartError(
            f"your {RESUME_PART} left the request with {req.num_tokens} tokens, {req.num_computed_tokens} computed, "
            f"status {req.status.name}, swapped_kv {'= the received KV' if state[3] else 'not the received KV'}; the "
            f"engine needs {P + 1} tokens (prompt + first token), {P} computed (the first token's KV is computed by "
            f"the next decode step), status SWAPPED with swapped_kv = kv")
    m = req.metrics
    m.first_scheduled_time, m.first_token_time = meta["first_scheduled_time"], meta["first_token_time"]
    m.token_times = [meta["first_token_time"]]
    req.num_cached_tokens = meta.get("num_cached_tokens", 0)
    return engine.admit(req)


def _report(engine, who: str, to_router, client, reads_store: bool = False) -> None:
    """Answer the router's ("stats",): this worker's blocks and store traffic (`store_handoff.worker_report`)."""
    from lab_utils.disagg.store_handoff import worker_report

    to_router.send(("stats", who, worker_report(engine, client, reads_store)))


def _orphaned() -> bool:
    """True once the router's process has gone (killed without closing us): then a worker exits by itself."""
    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def _use_learner_dir(learner_dir: str | None) -> None:
    if learner_dir:  # the worker loads the learner's saved parts from the router's my_engine/
        import os

        os.environ["LAB_LEARNER_DIR"] = learner_dir


def _engine_parts(upto: str | None):
    """The learner's saved engine parts up to lab `upto` (None: the reference engine), and their names."""
    if not upto:
        return None, []
    from lab_utils.course import learner_parts

    parts = learner_parts.parts(upto=upto, quiet=True)
    return parts, sorted(n for n in parts.overrides if not n.startswith("disagg."))


def prefill_main(model, config, device, dtype, extra_eos, requests, to_router, kv_conn, threads,
                 learner_parts=(), learner_dir=None, audit_kv=False, engine_parts_upto=None,
                 store_client=None) -> None:
    """Prefill worker: requests in from the router, KV out to the decode worker, notes back to the router
    (with `audit_kv`, the digests of each request's blocks as its cache held them when it was exported). With
    `store_client`, the prompt's full blocks go to the store and its prefix cache reads blocks from there."""
    torch.set_num_threads(threads)
    try:
        _use_learner_dir(learner_dir)
        parts, engine_used = _engine_parts(engine_parts_upto)
        engine = build_engine(model, config, device, dtype, extra_eos, parts)
        sender = KVSender(kv_conn)
        fns, used = load_disagg_parts([n for n in learner_parts if n in (EXPORT_PART, META_PART)])
        reads_store = False
        if store_client is not None:
            from lab_utils.disagg.store_handoff import BLOCK_SIZE_KEY, NAMES_KEY, publish_prompt_kv, read_from_store

            reads_store = read_from_store(engine, store_client) is not None
        to_router.send(("ready", "prefill", used + engine_used))
        while True:
            msgs = []
            try:  # idle: wait for work; busy: take what has arrived and keep stepping
                msgs.append(requests.get(timeout=1.0) if not engine.has_unfinished() else requests.get_nowait())
                while True:
                    msgs.append(requests.get_nowait())
            except queue_mod.Empty:
                pass
            if _orphaned():
                return
            for msg in msgs:
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    _report(engine, "prefill", to_router, store_client, reads_store)
                    continue
                _, rid, ids, params, arrival = msg
                engine.add_request(ids, params, request_id=rid, arrival_time=arrival)
            if not engine.has_unfinished():
                continue
            for out in engine.step():
                req = engine.requests.get(out.request_id)
                if out.finished:
                    if out.finish_reason != "abort":  # ended at its first token, or rejected
                        to_router.send(("finished", out))
                    continue
                rec = TransferRecord(req.request_id, req.num_prompt_tokens)
                audit = {"prefill_kv_blocks": kv_block_digests(kv_cache_tensors(engine.kv_cache), list(req.block_table),
                                                               req.num_prompt_tokens, engine.kv_cache.block_size)
                         } if audit_kv else {}
                t0 = time.perf_counter()
                kv = export_prompt_kv(engine, req, fns[EXPORT_PART])
                rec.serialize_s = time.perf_counter() - t0
                meta = prompt_meta(req, fns[META_PART])
                engine.abort(req.request_id)  # its blocks go back to the prefill pool
                stored = {}
                if store_client is not None:  # full blocks to the store; the header and the tail on the pipe
                    bs = engine.kv_cache.block_size
                    names, kv, stored = publish_prompt_kv(store_client, kv, meta["prompt_token_ids"], bs)
                    meta = {**meta, NAMES_KEY: names, BLOCK_SIZE_KEY: bs}
                try:
                    sender.send(meta, kv, rec)
                except (BrokenPipeError, ConnectionResetError, EOFError) as e:
                    to_router.send(("kv_failed", req.request_id, f"{type(e).__name__}: {e}"))
                    continue
                to_router.send(("sent", req.request_id, rec.to_dict() | stored | audit))
    except BaseException:
        try:
            to_router.send(("error", "prefill", traceback.format_exc()))
        except OSError:
            pass


def _receive_kv(receiver: KVReceiver, inbox: queue_mod.Queue, store_client=None) -> None:
    """Decode worker's reader thread: drains the KV channel while the engine steps (the socket read releases the
    GIL), so a transfer never waits for a decode step and the prefill worker is never blocked on it. A header
    that names blocks in the store: the thread also gets them from there (kv None when one is missing)."""
    from lab_utils.disagg.store_handoff import BLOCK_SIZE_KEY, NAMES_KEY, fetch_prompt_kv

    while True:
        try:
            meta, kv, recv_s, load_s = receiver.recv()
        except (EOFError, OSError):
            inbox.put(None)  # the prefill side has gone
            return
        rec = dict(recv_s=recv_s, load_s=load_s)
        if NAMES_KEY in meta:
            names, bs = meta.pop(NAMES_KEY), meta.pop(BLOCK_SIZE_KEY)
            kv, got = fetch_prompt_kv(store_client, names, meta["prompt_token_ids"], bs, kv)
            rec.update(got, recomputed=kv is None)
        inbox.put((meta, kv, rec | {"received_at": now()}))


def decode_main(model, config, device, dtype, extra_eos, control, to_router, kv_conn, threads,
                learner_parts=(), learner_dir=None, audit_kv=False, engine_parts_upto=None,
                store_client=None) -> None:
    """Decode worker: KV in from the prefill worker, continuous batching of decodes, finished outputs out (with
    `audit_kv`, the digests of each request's blocks right after its KV was swapped in). With `store_client`,
    the prompt's full blocks come from the store; a request whose blocks the store no longer holds is recomputed."""
    torch.set_num_threads(threads)
    try:
        _use_learner_dir(learner_dir)
        parts, engine_used = _engine_parts(engine_parts_upto)
        engine = build_engine(model, config, device, dtype, extra_eos, parts)
        inbox: queue_mod.Queue = queue_mod.Queue()
        threading.Thread(target=_receive_kv, args=(KVReceiver(kv_conn), inbox, store_client), daemon=True).start()
        records: dict[str, dict] = {}
        fns, used = load_disagg_parts([n for n in learner_parts if n not in (EXPORT_PART, META_PART)])
        used = used + engine_used
        if IMPORT_PART in used:
            engine.scheduler.swap_in = functools.partial(swap_in_with, fns[IMPORT_PART], engine.kv_cache)
        audits: dict[str, list[str]] = {}
        if audit_kv:
            audit_swap_in(engine, audits)
        to_router.send(("ready", "decode", used))
        while True:
            try:
                msg = control.get_nowait()
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    _report(engine, "decode", to_router, store_client)
            except queue_mod.Empty:
                pass
            if _orphaned():
                return
            busy = engine.has_unfinished()
            try:  # admit every request whose KV has arrived; when idle, wait (briefly, to keep watching `control`)
                item = inbox.get_nowait() if busy else inbox.get(timeout=0.05)
                while True:
                    if item is not None:
                        meta, kv, rec = item
                        if kv is None:  # a block the store no longer held: prefill it again here
                            from lab_utils.disagg.store_handoff import admit_to_recompute

                            admit_to_recompute(engine, meta)
                        else:
                            admit_prefilled(engine, meta, kv, fns[RESUME_PART])
                        records[meta["request_id"]] = rec
                        busy = True
                    item = inbox.get_nowait()
            except queue_mod.Empty:
                pass
            if not busy:
                continue
            for out in engine.step():
                if out.finished:
                    rec = records.pop(out.request_id, {})
                    if out.request_id in audits:
                        rec["decode_kv_blocks"] = audits.pop(out.request_id)
                    to_router.send(("out", out, rec))
                    engine.requests.pop(out.request_id, None)
    except BaseException:
        try:
            to_router.send(("error", "decode", traceback.format_exc()))
        except OSError:
            pass
