"""Known mistakes in the engine parts of labs 01-04, each said only when a failed case shows its evidence.

A `Diagnoser` names one mistake: an id, a test on the `Evidence` of one failed case (the states before and after
both calls, their snapshots, both calls, the engine's complaint about the learner's result), and the line the
learner reads as "likely mistake". `MISTAKES` lists each part's diagnosers; `diagnose` picks the first whose
evidence holds. When none holds the failure shows the difference alone: a wrong guess misleads more than none.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lab_utils.checks.part_calls import Call, result_view
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


@dataclass
class Evidence:
    """Everything one failed case shows: the states before and after (reference `a`, yours `b`), their snapshots,
    both calls, and what the engine's guard said about your result (`error`)."""
    before: dict
    ref: dict
    you: dict
    ref_call: Call
    you_call: Call
    a: Scheduler
    b: Scheduler
    error: str | None = None

    @property
    def caching(self) -> bool:
        return self.a.bm.enable_prefix_caching

    def only_diff(self, key: str) -> bool:
        return [k for k in self.ref if self.ref[k] != self.you[k]] == [key] and \
            result_view(self.ref_call.result) == result_view(self.you_call.result)

    def scheduled(self, who: str) -> dict[str, int]:
        res = (self.ref_call if who == "ref" else self.you_call).result
        return {r.request_id: n for r, n in res.scheduled} if isinstance(res, SchedulerOutput) else {}

    def admitted(self, who: str) -> list[str]:
        """Requests the step started (waiting before it, or preempted in it and back), in step order."""
        back = self.preempted(who)
        return [rid for rid in self.scheduled(who) if rid not in self.before["running"] or rid in back]

    def preempted(self, who: str) -> list[str]:
        call = self.ref_call if who == "ref" else self.you_call
        res = call.out if call.out is not None else call.result
        return [r.request_id for r in res.preempted] if isinstance(res, SchedulerOutput) else []


@dataclass(frozen=True)
class Diagnoser:
    id: str
    evidence: Callable[[Evidence], bool]
    text: str


def _bad_start(ev: Evidence) -> bool:
    res = ev.you_call.result
    return bool(ev.error) and isinstance(res, SchedulerOutput) and any(
        r.num_cached_tokens > 0 and n > r.num_tokens - r.num_computed_tokens for r, n in res.scheduled)


def _mixed(ev: Evidence) -> bool:
    you = ev.scheduled("you")
    decodes = [rid for rid, n in you.items() if rid in ev.before["running"] and n == 1]
    return bool(decodes) and bool(ev.admitted("you")) and not (ev.admitted("ref") and any(
        rid in ev.before["running"] for rid in ev.scheduled("ref")))


def _not_fcfs(ev: Evidence) -> bool:
    you = [rid for rid in ev.admitted("you") if rid in ev.before["waiting"]]
    return bool(you) and you != ev.before["waiting"][:len(you)]


def _admitted_over_running(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    left_out = [rid for rid in ref if rid in ev.before["running"] and rid not in you]
    return bool(left_out) and bool(ev.admitted("you")) and not ev.preempted("ref")


def _admitted_after_preempt(ev: Evidence) -> bool:
    return bool(ev.preempted("ref")) and bool(ev.admitted("you")) and not ev.admitted("ref")


def _unchunked(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    a = {r.request_id: r for r in ev.a.running}
    chunked = [rid for rid in ev.admitted("ref") if ref[rid] < a[rid].num_tokens - a[rid].num_computed_tokens]
    return any(rid not in you for rid in chunked)


def _prompt_chunk_dropped(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    return any(n > 1 and rid in ev.before["running"] and you.get(rid, 0) < n for rid, n in ref.items())


def _scheduled_preempted(ev: Evidence) -> bool:
    """A request preempted in this step (no longer running) that the step scheduled all the same."""
    return any(rid in ev.scheduled("you") and ev.you["status"].get(rid) != "running" for rid in ev.preempted("you"))


def _retired_late(ev: Evidence) -> bool:
    """Ended requests sat in `running` when the step began, and your step admitted fewer than the reference's (the
    engine's guard saw nothing: you retired them later in the step)."""
    ended = [k for k, v in ev.before["status"].items() if v in ("finished", "aborted", "rejected")
             and k not in ev.before["waiting"]]
    you, ref = ev.admitted("you"), ev.admitted("ref")
    return ev.error is None and bool(ended) and len(you) < len(ref) and ref[:len(you)] == you


def _victim(ev: Evidence) -> bool:
    ref, you = ev.preempted("ref"), ev.preempted("you")
    return bool(ref) and bool(you) and ref[0] != you[0]


def _unrecorded_victims(ev: Evidence) -> bool:
    return bool(ev.preempted("ref")) and not ev.preempted("you") and ev.you["running"] != ev.before["running"]


def _gave_way_true(ev: Evidence) -> bool:
    return ev.ref_call.result is False and ev.you_call.result is True and \
        ev.preempted("ref") == ev.preempted("you")


def _too_few_victims(ev: Evidence) -> bool:
    ref, you = ev.preempted("ref"), ev.preempted("you")
    return 0 < len(you) < len(ref) and ref[:len(you)] == you


def _victim_state(ev: Evidence, key: str):
    rid = ev.you_call.req_id
    return ev.ref[key].get(rid), ev.you[key].get(rid)


def _not_reset(ev: Evidence) -> bool:
    ref, you = _victim_state(ev, "num_computed_tokens")
    return ref == 0 and you not in (0, None)


def _not_freed(ev: Evidence) -> bool:
    ref, you = _victim_state(ev, "block_tables")
    return ref == [] and (bool(you) or ev.ref["ref_counts"] != ev.you["ref_counts"])


def _not_front(ev: Evidence) -> bool:
    rid = ev.you_call.req_id
    return ev.ref["waiting"][:1] == [rid] and rid in ev.you["waiting"] and ev.you["waiting"][:1] != [rid]


_HOST_COPY = "host copy (req.swapped_kv: the blocks swap_out copied)"


def _swap_state(ev: Evidence, who: str) -> tuple[str | None, int | None, list | None]:
    """The victim's status, computed tokens and host copy after a swap-mode preemption (yours or the reference's)."""
    snap, rid = (ev.ref if who == "ref" else ev.you), ev.you_call.req_id
    return snap["status"].get(rid), snap["num_computed_tokens"].get(rid), snap[_HOST_COPY].get(rid)


def _swap_ignored(ev: Evidence) -> bool:
    status, _, _ = _swap_state(ev, "ref")
    you_status, _, you_copy = _swap_state(ev, "you")
    return status == "swapped" and you_status == "waiting" and you_copy is None


def _freed_before_swap(ev: Evidence) -> bool:
    _, _, ref_copy = _swap_state(ev, "ref")
    _, _, you_copy = _swap_state(ev, "you")
    return bool(ref_copy) and you_copy == []


def _swapped_not_marked(ev: Evidence) -> bool:
    status, _, ref_copy = _swap_state(ev, "ref")
    you_status, _, you_copy = _swap_state(ev, "you")
    return status == "swapped" and you_status != "swapped" and you_copy == ref_copy


def _swapped_and_reset(ev: Evidence) -> bool:
    status, computed, _ = _swap_state(ev, "ref")
    you_status, you_computed, you_copy = _swap_state(ev, "you")
    return status == you_status == "swapped" and computed and you_computed == 0 and you_copy is not None


def _still_running(ev: Evidence) -> bool:
    return ev.you_call.req_id in ev.you["running"] and ev.you_call.req_id not in ev.ref["running"]


def _grow_changed_on_false(ev: Evidence) -> bool:
    return ev.ref_call.result is False and (ev.you_call.result is not False or ev.you != ev.ref)


def _grow_count(ev: Evidence) -> bool:
    a, b = ev.ref_call.req, ev.you_call.req
    return a is not None and b is not None and len(a.block_table) != len(b.block_table)


def _grow_no_take_block(ev: Evidence) -> bool:
    a, b = ev.ref_call.req, ev.you_call.req
    return a is not None and b is not None and len(a.block_table) == len(b.block_table) and ev.ref != ev.you


def _block(ev: Evidence) -> int | None:
    return ev.you_call.block_id


def _place(snap: dict, bid: int) -> str:
    if bid in snap["cached blocks (evictable, LRU order)"]:
        return "cached"
    return "free" if bid in snap["free blocks (free_ids)"] else "nowhere"


def _dropped_all_refs(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.before["ref_counts"][bid] > 1 and ev.you["ref_counts"][bid] != \
        ev.before["ref_counts"][bid] - 1


def _recycle_skipped(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.before["ref_counts"][bid] == 1 and ev.you["ref_counts"][bid] == 0 and (
        _place(ev.ref, bid) != _place(ev.you, bid) or ev.ref["block names (block.hash, block.token_ids)"] !=
        ev.you["block names (block.hash, block.token_ids)"])


def _recycled_too_early(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.you["ref_counts"][bid] == ev.ref["ref_counts"][bid] > 0 and \
        _place(ev.you, bid) != "nowhere"


def _named_blocks(snap: dict) -> dict:
    return snap["block names (block.hash, block.token_ids)"]


def _named_with_caching_off(ev: Evidence) -> bool:
    return not ev.caching and (len(_named_blocks(ev.you)) > len(_named_blocks(ev.ref))
                               or len(ev.you["hash_to_block"]) > len(ev.ref["hash_to_block"]))


def _names_without_ids(ev: Evidence) -> bool:
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    return any(b in ref and you[b][0] == ref[b][0] and you[b][1] != ref[b][1] for b in you)


def _overwrote_name(ev: Evidence) -> bool:
    ref, you = ev.ref["hash_to_block"], ev.you["hash_to_block"]
    return any(h in ref and ref[h] != you[h] and ev.before["hash_to_block"].get(h) == ref[h] for h in you)


def _named_uncomputed(ev: Evidence) -> bool:
    req = ev.you_call.req
    if req is None:
        return False
    full = min(req.num_computed_tokens, req.num_tokens) // ev.b.bm.block_size
    ref = _named_blocks(ev.ref)
    return any(bid in _named_blocks(ev.you) and bid not in ref for bid in req.block_table[full:])


def _unchained(ev: Evidence) -> bool:
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    return any(b in ref and you[b][0] != ref[b][0] and you[b][1] == ref[b][1] for b in you)


def _matched_with_caching_off(ev: Evidence) -> bool:
    return not ev.caching and bool(ev.you_call.result)


def _matched_whole_prompt(ev: Evidence) -> bool:
    req, you, ref = ev.you_call.req, ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and req is not None and len(you) > len(ref) and \
        len(you) * ev.b.bm.block_size >= req.num_prompt_tokens


def _matched_other_tokens(ev: Evidence) -> bool:
    """A block in your result that its position's chained name leads to, holding other tokens (a collision)."""
    req, you, bm = ev.you_call.req, ev.you_call.result, ev.b.bm
    if not isinstance(you, list) or req is None:
        return False
    name, bs = None, bm.block_size
    for i, bid in enumerate(you):
        ids = tuple(req.prompt_token_ids[i * bs:(i + 1) * bs])
        name = BlockManager.hash_block(bm, name, ids)
        if bm.hash_to_block.get(name) == bid and bm.blocks[bid].token_ids != ids:
            return True
    return False


def _matched_a_block_short(ev: Evidence) -> bool:
    """You stopped one block early, at num_prompt_tokens // block_size - 1 blocks, where the prompt ends mid-block."""
    req, you, ref = ev.you_call.req, ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and req is not None and len(ref) > len(you) == \
        req.num_prompt_tokens // ev.b.bm.block_size - 1 and ref[:len(you)] == you


def _matched_too_few(ev: Evidence) -> bool:
    you, ref = ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and len(you) < len(ref) and ref[:len(you)] == you


def _matched_past_a_miss(ev: Evidence) -> bool:
    you, ref = ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and len(you) > len(ref) and you[:len(ref)] == ref


def _freed_cached(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == "cached" and _place(ev.you, bid) == "free"


def _cached_at_front(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == _place(ev.you, bid) == "cached" and \
        ev.ref["cached blocks (evictable, LRU order)"] != ev.you["cached blocks (evictable, LRU order)"]


def _cached_a_duplicate(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == "free" and _place(ev.you, bid) == "cached"


def _kept_name(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and bid not in _named_blocks(ev.ref) and bid in _named_blocks(ev.you)


def _evicted_other(ev: Evidence) -> bool:
    return ev.you_call.result != ev.ref_call.result


def _counted_free_ids_only(ev: Evidence) -> bool:
    """You answered False where the reference grew: the missing blocks exceed the free list but not free + cached."""
    a, b = ev.ref_call.req, ev.you_call.req
    if ev.ref_call.result is not True or ev.you_call.result is not False or a is None or b is None:
        return False
    missing = len(a.block_table) - len(b.block_table)
    return missing > len(ev.before["free blocks (free_ids)"]) and bool(ev.before["cached blocks (evictable, LRU order)"])


def _left_listed(ev: Evidence) -> bool:
    bid = ev.you_call.result
    return isinstance(bid, int) and bid in ev.you["cached blocks (evictable, LRU order)"]


def _evicted_keeps_name(ev: Evidence) -> bool:
    bid = ev.you_call.result
    return bid == ev.ref_call.result and isinstance(bid, int) and (
        bid in _named_blocks(ev.you) or bid in ev.you["hash_to_block"].values())


def _cached_and_free(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and bid in ev.you["cached blocks (evictable, LRU order)"] and \
        bid in ev.you["free blocks (free_ids)"]


def _named_too_few(ev: Evidence) -> bool:
    """A computed full block of the request that the reference named and you left without a name."""
    req = ev.you_call.req
    if req is None or not ev.caching:
        return False
    full = min(req.num_computed_tokens, req.num_tokens) // ev.b.bm.block_size
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    return any(bid in ref and bid not in you for bid in req.block_table[:full])


def _left_output_blocks_unnamed(ev: Evidence) -> bool:
    """Every computed full block the reference named and you did not holds output tokens (it ends past the
    prompt): the prompt's blocks are named, the answer's are not."""
    req = ev.you_call.req
    if req is None or not ev.caching:
        return False
    bs = ev.b.bm.block_size
    full = min(req.num_computed_tokens, req.num_tokens) // bs
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    missed = [i for i, bid in enumerate(req.block_table[:full]) if bid in ref and bid not in you]
    return bool(missed) and all((i + 1) * bs > req.num_prompt_tokens for i in missed)


def _named_from_prompt(ev: Evidence) -> bool:
    """A block past the prompt's end named with the prompt's ids instead of the request's tokens."""
    req, bs = ev.you_call.req, ev.b.bm.block_size
    if req is None:
        return False
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    for i, bid in enumerate(req.block_table):
        if (i + 1) * bs > req.num_prompt_tokens and bid in ref and bid in you and you[bid][1] != ref[bid][1] and \
                you[bid][1] == tuple(req.prompt_token_ids[i * bs:(i + 1) * bs]):
            return True
    return False


def _match_changed_state(ev: Evidence) -> bool:
    return result_view(ev.you_call.result) == result_view(ev.ref_call.result) and ev.you != ev.ref


_FORGET = ("the evicted block must forget its name: drop it from self.hash_to_block and clear block.hash and "
           "block.token_ids, or a later prompt would hit a block that now holds other tokens")


_START_RETURN = Diagnoser(
    "start_return", _bad_start,
    "n = self.start(req, n): start attaches the blocks the prefix cache already holds for the prompt and returns how "
    "many tokens are left to compute, fewer than you asked for; schedule that number")
_SKIP_PREEMPTED = Diagnoser(
    "skip_preempted", _scheduled_preempted,
    "in the loop over self.running, skip a request whose status is no longer Status.RUNNING: making room for an "
    "older request preempts the newest, and that one must not run in this step")
_RETIRE_FIRST = Diagnoser(
    "retire_first", _retired_late,
    "retire finished requests (status.done) at the start of the step, before admitting: while they sit in "
    "self.running they take up slots of max_num_seqs that waiting requests could have")
_FCFS = Diagnoser(
    "fcfs", _not_fcfs,
    "first come, first served: admit from the head of the queue (self.waiting[0]) and stop at the first request "
    "that does not fit; nobody overtakes it")

# each part's known mistakes, in the order they are tried: the first whose evidence holds is named
MISTAKES: dict[str, tuple[Diagnoser, ...]] = {
    # the scheduling steps (labs 01 and 03)
    "scheduler.schedule_continuous": (
        _SKIP_PREEMPTED,
        _RETIRE_FIRST,
        _START_RETURN,
        _FCFS,
        Diagnoser("prefill_first", _mixed,
                  "a prefill-first step runs either prompts or decodes, never both: decode the running requests only "
                  "when no prompt was admitted"),
    ),
    "scheduler.schedule_token_budget": (
        _SKIP_PREEMPTED,
        _RETIRE_FIRST,
        _START_RETURN,
        _FCFS,
        Diagnoser("no_admit_after_preempt", _admitted_after_preempt,
                  "when make_room had to preempt (out.preempted is not empty), memory is short: admit no new request "
                  "in this step (the preempted one would take the blocks straight back)"),
        Diagnoser("running_first", _admitted_over_running,
                  "running requests come first: each running request gets its tokens (a decode 1, an unfinished prompt "
                  "its next chunk) before any new prompt is admitted; new prompts take what is left of the budget"),
        Diagnoser("prompt_chunk", _prompt_chunk_dropped,
                  "a running request still in its prompt takes its next chunk, min(tokens left, budget), not 1 token: "
                  "running means decode or unfinished prefill"),
        Diagnoser("chunk_last", _unchunked,
                  "the last prompt admitted is chunked to fit the budget: n = min(tokens left, budget), not skipped"),
    ),
    # the allocator (lab 02)
    "block_manager.grow": (
        Diagnoser("grow_no_change", _grow_changed_on_false,
                  "when the pool cannot cover num_tokens, return False and change nothing (check before taking any "
                  "block)"),
        Diagnoser("grow_cached_count", _counted_free_ids_only,
                  "cached blocks can be taken too (take_block evicts the least recently used one when free_ids is "
                  "empty): compare the missing blocks with self.num_free_blocks (free and cached), not "
                  "len(self.free_ids)"),
        Diagnoser("grow_count", _grow_count,
                  "take exactly the missing blocks: blocks_needed(num_tokens) - len(req.block_table), none when the "
                  "table already covers num_tokens"),
        Diagnoser("grow_take_block", _grow_no_take_block,
                  "take each block with self.take_block(): it sets the block's ref_count to 1 and, when no block is "
                  "free, evicts the least recently used cached one"),
    ),
    "block_manager.release": (
        Diagnoser("release_last_ref", _dropped_all_refs,
                  "a block is reused only when its last reference is gone: release drops one reference "
                  "(ref_count -= 1), and other requests may still hold the block"),
        Diagnoser("release_early", _recycled_too_early,
                  "only the last reference hands a block on: call self.recycle(block_id) when ref_count reaches 0, "
                  "not before"),
        Diagnoser("release_recycle", _recycle_skipped,
                  "when the last reference goes, hand the block to self.recycle(block_id): it keeps a block that holds "
                  "a named prefix in the cache and frees the others (do not put it in free_ids yourself)"),
    ),
    # preemption (lab 02)
    "scheduler.make_room": (
        Diagnoser("victim_newest", _victim,
                  "the victim is the newest running request (self.running[-1]): it has the least work to lose"),
        Diagnoser("victims_recorded", _unrecorded_victims,
                  "append each victim to out.preempted: the step reports whom it preempted"),
        Diagnoser("gave_way", _gave_way_true,
                  "when the victim is req itself, it gave way: return False (it is back in the queue, not scheduled)"),
        Diagnoser("preempt_until_fits", _too_few_victims,
                  "one victim may not free enough: keep preempting (a loop) until self.bm.grow(req, num_tokens) "
                  "succeeds or req itself gave way"),
    ),
    "scheduler.preempt": (
        Diagnoser("preempt_swap_mode", _swap_ignored,
                  "with swap preemption (self.config.preemption_mode == \"swap\") the request keeps its progress: "
                  "self.swap_out(req) copies its KV to host memory, its num_computed_tokens stays and its status is "
                  "Status.SWAPPED; only recompute preemption starts over"),
        Diagnoser("preempt_swap_order", _freed_before_swap,
                  "swap out before you free: self.swap_out(req) copies the KV from the blocks in req.block_table, and "
                  "self.bm.free(req) empties that table (the host copy would hold nothing, or, once the blocks are "
                  "reused, another request's tokens)"),
        Diagnoser("preempt_swap_status", _swapped_not_marked,
                  "a swapped-out request is Status.SWAPPED: start() swaps its KV back in only for that status (as "
                  "WAITING it would be admitted as a fresh prompt, its host copy never read)"),
        Diagnoser("preempt_swap_keeps", _swapped_and_reset,
                  "a swapped-out request keeps req.num_computed_tokens: its KV comes back from host memory, nothing is "
                  "recomputed"),
        Diagnoser("preempt_off_batch", _still_running,
                  "take the request off the batch: self.running.remove(req)"),
        Diagnoser("preempt_free", _not_freed,
                  "free the request's blocks with self.bm.free(req): every reference it holds goes back"),
        Diagnoser("preempt_reset", _not_reset,
                  "recompute preemption starts over: req.num_computed_tokens = 0 and req.status = Status.WAITING (its "
                  "KV is gone)"),
        Diagnoser("preempt_front", _not_front,
                  "a preempted request goes to the front of the queue (self.waiting.appendleft(req)): it arrived "
                  "before everyone still waiting"),
        Diagnoser("preempt_request_count", lambda ev: ev.only_diff("req.metrics.preemptions"),
                  "count the preemption on the request too: req.metrics.preemptions += 1 (the per-request count the "
                  "engine reports), besides self.num_preemptions"),
        Diagnoser("preempt_count", lambda ev: ev.only_diff("num_preemptions"),
                  "count the preemption on the scheduler too: self.num_preemptions += 1"),
    ),
    # the prefix cache (lab 04)
    "block_manager.commit_full_blocks": (
        Diagnoser("commit_caching_off", _named_with_caching_off,
                  "with enable_prefix_caching off, commit_full_blocks names nothing (return at once): otherwise the "
                  "engine's 'caching off' runs cache too"),
        Diagnoser("commit_uncomputed", _named_uncomputed,
                  "name only blocks whose tokens are all computed: min(req.num_computed_tokens, req.num_tokens) // "
                  "block_size of them"),
        Diagnoser("commit_output_blocks", _left_output_blocks_unnamed,
                  "the blocks your commit_full_blocks left unnamed all hold output tokens: a block that generated "
                  "tokens filled is named too (its ids are the request's tokens, req.token_ids, not only the "
                  "prompt's): a follow-up turn sends the answer back in its prompt"),
        Diagnoser("commit_every_block", _named_too_few,
                  "name every full, computed block that has no name yet, not only the newest: one step can fill "
                  "several blocks (a whole prompt, a chunk), and each needs its name"),
        Diagnoser("commit_output_ids", _named_from_prompt,
                  "a block's ids are req.token_ids[i * block_size:(i + 1) * block_size], prompt and output tokens "
                  "alike: a full block of output tokens is cached too (a follow-up turn sends the answer back in its "
                  "prompt)"),
        Diagnoser("commit_token_ids", _names_without_ids,
                  "store each block's token ids with its name (block.token_ids = ids): match_prefix compares them to "
                  "tell a hit from a hash collision, so a block without them never hits"),
        Diagnoser("commit_setdefault", _overwrote_name,
                  "a name already in self.hash_to_block keeps the block it leads to (self.hash_to_block.setdefault): "
                  "the same tokens computed twice give two blocks with one name, and the cached one must stay "
                  "findable"),
        Diagnoser("commit_chain", _unchained,
                  "chain the names: block i's name is self.hash_block(name of block i-1, its token ids), starting "
                  "from None"),
    ),
    "block_manager.match_prefix": (
        Diagnoser("match_looks_only", _match_changed_state,
                  "match_prefix only looks: it returns the cached blocks and changes nothing (admit attaches them "
                  "and counts their references; can_admit calls match_prefix too, just to count)"),
        Diagnoser("match_caching_off", _matched_with_caching_off,
                  "with enable_prefix_caching off, match_prefix finds nothing (return []): otherwise the engine's "
                  "'caching off' runs cache too"),
        Diagnoser("match_whole_prompt", _matched_whole_prompt,
                  "leave at least one prompt token to compute (match at most (num_prompt_tokens - 1) // block_size "
                  "blocks): the step that computes the last prompt token produces the logits of the first output "
                  "token"),
        Diagnoser("match_collision", _matched_other_tokens,
                  "equal names almost always mean equal tokens, but not always: compare the cached block's token_ids "
                  "(self.blocks[bid].token_ids) with the prompt's, and treat a difference as a miss"),
        Diagnoser("match_bound", _matched_a_block_short,
                  "only the prompt's last token must stay to compute: match up to (num_prompt_tokens - 1) // "
                  "block_size blocks, so a prompt that ends mid-block can use every full block it has"),
        Diagnoser("match_walk", _matched_too_few,
                  "walk the prompt's full blocks in order, chaining the names (name = self.hash_block(previous name, "
                  "ids)), and keep each block id while the lookup in self.hash_to_block hits"),
        Diagnoser("match_stop", _matched_past_a_miss,
                  "stop at the first block that misses: a later block with equal tokens was computed after another "
                  "past"),
    ),
    "block_manager.recycle": (
        Diagnoser("recycle_one_place", _cached_and_free,
                  "a recycled block goes to one place: cached (self.evictable) when its name leads to it, else free "
                  "(self.free_ids); a cached block on the free list would be handed out while a lookup still finds "
                  "it"),
        Diagnoser("recycle_keep", _freed_cached,
                  "a block that holds a named prefix (self.hash_to_block[block.hash] == block_id) stays cached: put it "
                  "at the end of self.evictable, not in free_ids, so a later prompt can still hit it"),
        Diagnoser("recycle_lru_end", _cached_at_front,
                  "a recycled block is the most recently used: it goes to the end of self.evictable, not the front"),
        Diagnoser("recycle_duplicate", _cached_a_duplicate,
                  "a block is cached only if its name leads to it (self.hash_to_block.get(block.hash) == block_id); "
                  "a duplicate no lookup can find is freed"),
        Diagnoser("recycle_forget", _kept_name,
                  "a freed block forgets its name (block.hash = None, block.token_ids = ()): its slots will hold other "
                  "tokens"),
    ),
    "block_manager.evict": (
        Diagnoser("evict_lru", _evicted_other,
                  "you evicted another block than the least recently used one: take the front of self.evictable; the "
                  "end holds the most recently used"),
        Diagnoser("evict_unlist", _left_listed,
                  "take the evicted block out of self.evictable (popitem(last=False) returns the front and removes "
                  "it): a block still listed would be evicted, and handed out, a second time"),
        Diagnoser("evict_forget", _evicted_keeps_name, _FORGET),
    ),
}

DIAGNOSERS: list[Diagnoser] = list(dict.fromkeys(d for ds in MISTAKES.values() for d in ds))  # every one, once


def diagnose(ev: Evidence, diagnosers: Sequence[Diagnoser]) -> Diagnoser | None:
    """The first of `diagnosers` (one part's) whose evidence holds, else None."""
    for d in diagnosers:
        try:
            if d.evidence(ev):
                return d
        except (KeyError, IndexError, TypeError, AttributeError):
            continue
    return None
