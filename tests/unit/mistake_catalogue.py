"""What learners really get wrong in the engine parts of labs 01-04: one entry per mistake, with the wrong
version as code, the check that must catch it (in the lab that teaches the part), and what the learner must be
told (words the failure message must hold, and the diagnoser that must explain it, or None when the check's own
message says it). `test_mistake_catalogue.py` runs every entry through its check.

Sources: a tester who wrote every exercise from the notebooks and then 31 realistic wrong versions; the wrong
versions the notebook injection tests use (tests/notebooks/test_inject_lab0*.py); and mistakes seen in review.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lab_utils.engine.request import Status
from lab_utils.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class Mistake:
    part: str  # the engine part, e.g. "scheduler.preempt"
    lab: str  # the lab whose check must catch it
    check: str  # that check, e.g. "lab02.check_preemption"
    wrong: Callable  # the wrong version
    told: str  # words the learner must read in the failure
    diagnosis: str | None  # the diagnoser that must explain it (None: the check's own message names it)

    @property
    def id(self) -> str:
        return f"{self.part.split('.')[1]}-{self.wrong.__name__}"


CATALOGUE: list[Mistake] = []
_CHECKS = {"01": {"scheduler.schedule_continuous": "lab01.check_schedule_continuous",
                  "engine.stop_reason": "lab01.check_stop_reason"},
           "02": {"block_manager.grow": "lab02.check_allocator", "block_manager.release": "lab02.check_allocator",
                  "scheduler.make_room": "lab02.check_preemption", "scheduler.preempt": "lab02.check_preemption"},
           "03": {"scheduler.schedule_token_budget": "lab03.check_schedule_token_budget"},
           "04": {"block_manager.hash_block": "lab04.check_hash_block",
                  "block_manager.match_prefix": "lab04.check_match_prefix",
                  "block_manager.commit_full_blocks": "lab04.check_commit_full_blocks",
                  "block_manager.recycle": "lab04.check_recycle", "block_manager.evict": "lab04.check_evict"}}


def mistake(part: str, told: str, diagnosis: str | None):
    lab = next(lab for lab, parts in _CHECKS.items() if part in parts)

    def register(fn: Callable) -> Callable:
        CATALOGUE.append(Mistake(part, lab, _CHECKS[lab][part], fn, told, diagnosis))
        return fn
    return register


# ================================================================ lab 01: schedule_continuous, stop_reason
@mistake("scheduler.schedule_continuous", "retire finished requests", None)
def no_retire(self):
    """Finished requests never leave self.running (injection test)."""
    out = SchedulerOutput()
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    if out.scheduled:
        return out
    for req in list(self.running):
        if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    return out


@mistake("scheduler.schedule_continuous", "n = self.start(req, n)", "start_return")
def ignores_start(self):
    """self.start(req, n) instead of n = self.start(req, n): harmless without prefix caching (tester)."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            break
        self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    if out.scheduled:
        return out
    for req in list(self.running):
        if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    return out


@mistake("scheduler.schedule_continuous", "first come, first served", "fcfs")
def skips_the_head(self):
    """A request that does not fit is skipped and the next one admitted."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    for req in list(self.waiting):
        n = req.num_tokens - req.num_computed_tokens
        if len(self.running) >= self.config.max_num_seqs or n > budget:
            continue
        if not self.can_start(req, n):
            continue
        self.waiting.remove(req)
        self.waiting.appendleft(req)
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    if out.scheduled:
        return out
    for req in list(self.running):
        if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    return out


@mistake("scheduler.schedule_continuous", "prompts or decodes, never both", "prefill_first")
def decodes_beside_prompts(self):
    """Decodes everyone even in a step that admitted prompts."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    old = list(self.running)
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    for req in old:
        if req.status is Status.RUNNING and budget > 0 and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
            budget -= 1
    return out


@mistake("scheduler.schedule_continuous", "max_num_batched_tokens", None)
def ignores_the_budget(self):
    """Admits prompts without counting them against the step's token budget."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if not self.can_start(req, n):
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
    if out.scheduled:
        return out
    for req in list(self.running):
        if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    return out


@mistake("scheduler.schedule_continuous", "grow its block table first", None)
def decodes_without_room(self):
    """Schedules every decode without make_room: a decode that crosses a block boundary has no block."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    if out.scheduled:
        return out
    for req in list(self.running):
        if req.status is Status.RUNNING:
            out.scheduled.append((req, 1))
    return out


def _continuous_step(self, *, iterate_waiting=False, retire_first=True, skip_preempted=True):
    """The prefill-first step with one switch turned the wrong way (for the entries below)."""
    out = SchedulerOutput()
    if retire_first:
        self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    if iterate_waiting:
        for req in self.waiting:
            n = req.num_tokens - req.num_computed_tokens
            if len(self.running) >= self.config.max_num_seqs or n > budget or not self.can_start(req, n):
                break
            n = self.start(req, n)
            out.scheduled.append((req, n))
            budget -= n
    else:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget or not self.can_start(req, n):
                break
            n = self.start(req, n)
            out.scheduled.append((req, n))
            budget -= n
    if not retire_first:
        self.running = [r for r in self.running if not r.status.done]
    if out.scheduled:
        return out
    for req in list(self.running):
        if (req.status is Status.RUNNING or not skip_preempted) and \
                self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    return out


@mistake("scheduler.schedule_continuous", "while self.waiting", None)
def admits_while_iterating(self):
    """for req in self.waiting while start() pops from it: the deque changes under the loop (tester)."""
    return _continuous_step(self, iterate_waiting=True)


@mistake("scheduler.schedule_continuous", "at the start of the step", "retire_first")
def retires_after_admitting(self):
    """Retires at the end of the step: admission counted finished requests as taking slots (tester)."""
    return _continuous_step(self, retire_first=False)


@mistake("scheduler.schedule_continuous", "no longer Status.RUNNING", "skip_preempted")
def decodes_the_preempted(self):
    """Decodes every request of self.running, also one that making room for an older one preempted (tester: passed
    every random state, which rarely preempt in a step)."""
    return _continuous_step(self, skip_preempted=False)


@mistake("engine.stop_reason", "ignore_eos", None)
def stops_on_eos_always(req, token, eos_ids, max_model_len):
    """An end token stops the request even with ignore_eos=True."""
    if token in eos_ids or token in req.params.stop_token_ids:
        return "stop"
    return "length" if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len else None


@mistake("engine.stop_reason", "output tokens only", None)
def counts_all_tokens(req, token, eos_ids, max_model_len):
    """max_tokens compared with prompt + output tokens."""
    if (token in eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
        return "stop"
    return "length" if req.num_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len else None


def _stop(req, token, eos_ids, max_model_len, *, late_length=False, late_model_len=False, length_first=False,
          ignore_all=False):
    p = req.params
    length = (req.num_output_tokens > p.max_tokens if late_length else req.num_output_tokens >= p.max_tokens) or \
        (req.num_tokens > max_model_len if late_model_len else req.num_tokens >= max_model_len)
    if length_first and length:
        return "length"
    if ignore_all:
        stop = not p.ignore_eos and (token in eos_ids or token in p.stop_token_ids)
    else:
        stop = (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids
    return "stop" if stop else "length" if length else None


@mistake("engine.stop_reason", "compare with >=, not >", None)
def length_one_late(req, token, eos_ids, max_model_len):
    """num_output_tokens > max_tokens: one token too many (tester)."""
    return _stop(req, token, eos_ids, max_model_len, late_length=True)


@mistake("engine.stop_reason", "tokens is full", None)
def model_len_one_late(req, token, eos_ids, max_model_len):
    """num_tokens > max_model_len: the sequence outgrows the model's length."""
    return _stop(req, token, eos_ids, max_model_len, late_model_len=True)


@mistake("engine.stop_reason", "check the token first", None)
def length_before_stop(req, token, eos_ids, max_model_len):
    """The length checked first: an end token on the last allowed position says 'length'."""
    return _stop(req, token, eos_ids, max_model_len, length_first=True)


@mistake("engine.stop_reason", "ignore_eos ignores the end token only", None)
def ignore_eos_ignores_stop_ids(req, token, eos_ids, max_model_len):
    """ignore_eos=True silences stop_token_ids too."""
    return _stop(req, token, eos_ids, max_model_len, ignore_all=True)


# ================================================================ lab 02: grow, release, make_room, preempt
@mistake("block_manager.grow", "change nothing", "grow_no_change")
def grow_takes_first(self, req, num_tokens):
    """Takes blocks one by one and gives up half-way when the pool runs dry."""
    for _ in range(self.blocks_needed(num_tokens) - len(req.block_table)):
        if not self.num_free_blocks:
            return False
        req.block_table.append(self.take_block())
    return True


@mistake("block_manager.grow", "take exactly the missing blocks", "grow_count")
def grow_one_too_many(self, req, num_tokens):
    """Floor + 1 instead of ceil: a block too many when num_tokens fills its last block exactly."""
    missing = num_tokens // self.block_size + 1 - len(req.block_table)
    if missing > self.num_free_blocks:
        return False
    for _ in range(max(missing, 0)):
        req.block_table.append(self.take_block())
    return True


@mistake("block_manager.grow", "self.take_block()", "grow_take_block")
def grow_pops_free_ids(self, req, num_tokens):
    """Pops free_ids directly: no ref count, and no eviction when only cached blocks are left."""
    missing = self.blocks_needed(num_tokens) - len(req.block_table)
    if missing > len(self.free_ids):
        return False
    for _ in range(missing):
        req.block_table.append(self.free_ids.pop())
    return True


@mistake("block_manager.grow", "free and cached", "grow_cached_count")
def grow_counts_free_ids_only(self, req, num_tokens):
    """Compares the missing blocks with len(self.free_ids): cached blocks, which take_block evicts, not counted."""
    missing = self.blocks_needed(num_tokens) - len(req.block_table)
    if missing > len(self.free_ids):
        return False
    for _ in range(max(missing, 0)):
        req.block_table.append(self.take_block())
    return True


@mistake("block_manager.release", "last reference", "release_last_ref")
def release_ignores_count(self, block_id):
    """Drops every reference at once (injection test)."""
    self.blocks[block_id].ref_count = 0
    self.recycle(block_id)


@mistake("block_manager.release", "self.recycle(block_id)", "release_recycle")
def release_without_recycle(self, block_id):
    """Never calls recycle: a freed block goes straight to free_ids, so nothing stays cached (tester)."""
    block = self.blocks[block_id]
    block.ref_count -= 1
    if block.ref_count == 0:
        self.free_ids.append(block_id)


@mistake("block_manager.release", "self.recycle(block_id)", "release_recycle")
def release_never_frees(self, block_id):
    """Counts the reference down and stops there: every block leaks."""
    self.blocks[block_id].ref_count -= 1


@mistake("block_manager.release", "not before", "release_early")
def release_recycles_every_time(self, block_id):
    """Recycles the block at every release, while others still hold it."""
    self.blocks[block_id].ref_count -= 1
    self.recycle(block_id)


@mistake("scheduler.make_room", "newest running request", "victim_newest")
def preempts_the_oldest(self, req, num_tokens, out):
    """The victim is self.running[0] (injection test)."""
    while not self.bm.grow(req, num_tokens):
        victim = self.running[0]
        self.preempt(victim)
        out.preempted.append(victim)
        if victim is req:
            return False
    return True


@mistake("scheduler.make_room", "return False", "gave_way")
def room_true_after_giving_way(self, req, num_tokens, out):
    """Returns True although req itself was preempted."""
    while not self.bm.grow(req, num_tokens):
        victim = self.running[-1]
        self.preempt(victim)
        out.preempted.append(victim)
        if victim is req:
            break
    return True


@mistake("scheduler.make_room", "out.preempted", "victims_recorded")
def room_unrecorded(self, req, num_tokens, out):
    """Preempts but never reports the victims in out.preempted."""
    while not self.bm.grow(req, num_tokens):
        victim = self.running[-1]
        self.preempt(victim)
        if victim is req:
            return False
    return True


@mistake("scheduler.make_room", "keep preempting", "preempt_until_fits")
def room_one_victim(self, req, num_tokens, out):
    """Preempts once and hopes it was enough."""
    if self.bm.grow(req, num_tokens):
        return True
    victim = self.running[-1]
    self.preempt(victim)
    out.preempted.append(victim)
    return victim is not req and self.bm.grow(req, num_tokens)


def _preempt(self, req, *, off_batch=True, count_sched=True, count_req=True, free=True, reset=True, front=True,
             swap=True, swap_first=True, swapped_status=True, swap_keeps=True, count_req_on_swap=True):
    """Preemption (recompute, and swap when the engine is set to it) with one switch turned the wrong way (for
    the entries below)."""
    if off_batch:
        self.running.remove(req)
    if count_sched:
        self.num_preemptions += 1
    if count_req:
        req.metrics.preemptions += 1
    if swap and self.config.preemption_mode == "swap":
        if not count_req_on_swap:
            req.metrics.preemptions -= 1
        if swap_first:
            self.swap_out(req)
        self.bm.free(req)
        if not swap_first:
            self.swap_out(req)
        if not swap_keeps:
            req.num_computed_tokens = 0
        req.status = Status.SWAPPED if swapped_status else Status.WAITING
    else:
        if free:
            self.bm.free(req)
        else:
            req.block_table = []
        if reset:
            req.num_computed_tokens = 0
        req.status = Status.WAITING
    if front:
        self.waiting.appendleft(req)
    else:
        self.waiting.append(req)


@mistake("scheduler.preempt", "req.metrics.preemptions", "preempt_request_count")
def preempt_uncounted(self, req):
    """Counts the preemption on the scheduler only (tester)."""
    _preempt(self, req, count_req=False)


@mistake("scheduler.preempt", "self.num_preemptions", "preempt_count")
def preempt_counts_request_only(self, req):
    """Counts the preemption on the request only."""
    _preempt(self, req, count_sched=False)


@mistake("scheduler.preempt", "front of the queue", "preempt_front")
def preempt_to_the_back(self, req):
    """Sends the victim to the back of the queue."""
    _preempt(self, req, front=False)


@mistake("scheduler.preempt", "starts over", "preempt_reset")
def preempt_keeps_progress(self, req):
    """Frees the blocks but keeps num_computed_tokens: the KV it claims is gone."""
    _preempt(self, req, reset=False)


@mistake("scheduler.preempt", "self.running.remove(req)", "preempt_off_batch")
def preempt_stays_running(self, req):
    """Frees and requeues the request but leaves it in self.running."""
    _preempt(self, req, off_batch=False)


@mistake("scheduler.preempt", "self.bm.free(req)", "preempt_free")
def preempt_forgets_blocks(self, req):
    """Empties the block table without releasing the blocks: they leak."""
    _preempt(self, req, free=False)


@mistake("scheduler.preempt", "swap preemption", "preempt_swap_mode")
def preempt_ignores_swap(self, req):
    """Recomputes whatever the engine's preemption mode: the swap mode's host copy is never made."""
    _preempt(self, req, swap=False)


@mistake("scheduler.preempt", "swap out before you free", "preempt_swap_order")
def preempt_frees_before_swapping(self, req):
    """Frees the blocks, then swaps out: the copy is taken from an empty block table."""
    _preempt(self, req, swap_first=False)


@mistake("scheduler.preempt", "Status.SWAPPED", "preempt_swap_status")
def preempt_swapped_as_waiting(self, req):
    """Swaps out but leaves the status WAITING: start() would never swap the KV back in."""
    _preempt(self, req, swapped_status=False)


@mistake("scheduler.preempt", "keeps req.num_computed_tokens", "preempt_swap_keeps")
def preempt_swap_starts_over(self, req):
    """Swaps out and also resets num_computed_tokens, as recompute does."""
    _preempt(self, req, swap_keeps=False)


@mistake("scheduler.preempt", "req.metrics.preemptions", "preempt_request_count")
def preempt_swap_uncounted(self, req):
    """Counts the request's preemption in the recompute branch only."""
    _preempt(self, req, count_req_on_swap=False)


# ================================================================ lab 03: schedule_token_budget
@mistake("scheduler.schedule_token_budget", "running requests come first", "running_first")
def admits_first(self):
    """New prompts admitted before the running requests get their tokens (injection test)."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    old = list(self.running)
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.can_start(req, n):
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    for req in old:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if budget > 0 and req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + n, out):
            out.scheduled.append((req, n))
            budget -= n
    return out


def _budget_step(self, *, use_start: bool = True, after_preempt: bool = False, chunk_last: bool = True,
                 prompt_chunks: bool = True, retire: bool = True, skip_preempted: bool = True):
    """The token-budget step with one switch turned the wrong way (for the entries below)."""
    out = SchedulerOutput()
    if retire:
        self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    for req in list(self.running):
        if budget <= 0:
            break
        if req.status is not Status.RUNNING and skip_preempted:
            continue
        left = req.num_tokens - req.num_computed_tokens
        n = min(left, budget) if prompt_chunks else 1
        if self.make_room(req, req.num_computed_tokens + n, out):
            out.scheduled.append((req, n))
            budget -= n
    if out.preempted and not after_preempt:
        return out
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        left = req.num_tokens - req.num_computed_tokens
        if left > budget and not chunk_last:
            break
        n = min(left, budget)
        if not self.can_start(req, n):
            break
        if use_start:
            n = self.start(req, n)
        else:
            self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    return out


@mistake("scheduler.schedule_token_budget", "n = self.start(req, n)", "start_return")
def budget_ignores_start(self):
    """self.start(req, n) instead of n = self.start(req, n) (tester: passed all of lab 03, stopped lab 04)."""
    return _budget_step(self, use_start=False)


@mistake("scheduler.schedule_token_budget", "admit no new request", "no_admit_after_preempt")
def admits_after_preempting(self):
    """Admits new prompts in a step that had to preempt."""
    return _budget_step(self, after_preempt=True)


@mistake("scheduler.schedule_token_budget", "chunked to fit", "chunk_last")
def never_chunks_a_new_prompt(self):
    """A new prompt longer than what is left of the budget waits instead of starting with a chunk."""
    return _budget_step(self, chunk_last=False)


@mistake("scheduler.schedule_token_budget", "next chunk", "prompt_chunk")
def one_token_per_running_request(self):
    """Gives every running request one token, also those still in their prompt."""
    return _budget_step(self, prompt_chunks=False)


@mistake("scheduler.schedule_token_budget", "retire", None)
def budget_no_retire(self):
    """Finished requests stay in self.running."""
    return _budget_step(self, retire=False)


@mistake("scheduler.schedule_token_budget", "no longer Status.RUNNING", "skip_preempted")
def budget_schedules_the_preempted(self):
    """Gives every request of self.running its tokens, also one preempted earlier in the loop (tester: passed every
    random state)."""
    return _budget_step(self, skip_preempted=False)


# ================================================================ lab 04: the prefix cache
@mistake("block_manager.hash_block", "parent_hash", None)
def hash_without_parent(self, parent_hash, token_ids):
    """A block's name from its own tokens only."""
    return hash(token_ids)


@mistake("block_manager.hash_block", "hash((parent_hash, token_ids))", None)
def hash_sum(self, parent_hash, token_ids):
    """Chains by adding the parent's name (tester: was told the name ignores parent_hash, which it does not)."""
    return hash(token_ids) + (parent_hash or 0)


def _match(self, req, *, check_flag=True, leave_one=True, compare_ids=True, stop=True):
    if check_flag and not self.enable_prefix_caching:
        return []
    found, name, B = [], None, self.block_size
    n = (req.num_prompt_tokens - 1) // B if leave_one else req.num_prompt_tokens // B
    for i in range(n):
        ids = tuple(req.prompt_token_ids[i * B:(i + 1) * B])
        name = self.hash_block(name, ids)
        bid = self.hash_to_block.get(name)
        if bid is None or (compare_ids and self.blocks[bid].token_ids != ids):
            if stop:
                break
            continue
        found.append(bid)
    return found


@mistake("block_manager.match_prefix", "enable_prefix_caching off", "match_caching_off")
def match_ignores_the_switch(self, req):
    """Matches even with enable_prefix_caching off (tester: the 'caching off' run cached too)."""
    return _match(self, req, check_flag=False)


@mistake("block_manager.match_prefix", "leave at least one prompt token", "match_whole_prompt")
def match_whole_prompt(self, req):
    """Matches every full block of the prompt (injection test)."""
    return _match(self, req, leave_one=False)


@mistake("block_manager.match_prefix", "keep each block id while", "match_walk")
def match_first_block_only(self, req):
    """Returns at the first hit instead of walking on."""
    return _match(self, req)[:1]


@mistake("block_manager.match_prefix", "token_ids", "match_collision")
def match_trusts_the_name(self, req):
    """Takes a name's block without comparing its tokens."""
    return _match(self, req, compare_ids=False)


@mistake("block_manager.match_prefix", "stop at the first block that misses", "match_stop")
def match_past_a_miss(self, req):
    """Skips a block that misses and goes on matching."""
    return _match(self, req, stop=False)


@mistake("block_manager.match_prefix", "(num_prompt_tokens - 1) // block_size", "match_bound")
def match_leaves_a_block(self, req):
    """Leaves a whole block to compute (num_prompt_tokens // block_size - 1 blocks), not one token."""
    if not self.enable_prefix_caching:
        return []
    found, name, B = [], None, self.block_size
    for i in range(req.num_prompt_tokens // B - 1):
        ids = tuple(req.prompt_token_ids[i * B:(i + 1) * B])
        name = self.hash_block(name, ids)
        bid = self.hash_to_block.get(name)
        if bid is None or self.blocks[bid].token_ids != ids:
            break
        found.append(bid)
    return found


@mistake("block_manager.match_prefix", "changes nothing", "match_looks_only")
def match_takes_refs(self, req):
    """Counts a reference on each block it finds, as if matching attached them (admit does that)."""
    found = _match(self, req)
    for bid in found:
        self.blocks[bid].ref_count += 1
    return found


def _commit(self, req, *, check_flag=True, keep_ids=True, setdefault=True, computed=True, chain=True):
    if check_flag and not self.enable_prefix_caching:
        return
    B, parent = self.block_size, None
    upto = min(req.num_computed_tokens, req.num_tokens) if computed else len(req.block_table) * B
    for i in range(min(upto, req.num_tokens) // B):
        ids = tuple(req.token_ids[i * B:(i + 1) * B])
        parent = self.hash_block(parent if chain else None, ids)
        block = self.blocks[req.block_table[i]]
        if block.hash is None:
            block.hash = parent
            if keep_ids:
                block.token_ids = ids
            if setdefault:
                self.hash_to_block.setdefault(parent, block.block_id)
            else:
                self.hash_to_block[parent] = block.block_id


@mistake("block_manager.commit_full_blocks", "enable_prefix_caching off", "commit_caching_off")
def commit_ignores_the_switch(self, req):
    """Names blocks with caching off (tester: the 'caching off' run cached too)."""
    _commit(self, req, check_flag=False)


@mistake("block_manager.commit_full_blocks", "block.token_ids", "commit_token_ids")
def commit_without_token_ids(self, req):
    """Names a block without its token ids (tester: showed only as 'engine steps 121 vs 85')."""
    _commit(self, req, keep_ids=False)


@mistake("block_manager.commit_full_blocks", "setdefault", "commit_setdefault")
def commit_overwrites(self, req):
    """hash_to_block[name] = block_id: a second copy of the same tokens takes the name over (tester)."""
    _commit(self, req, setdefault=False)


@mistake("block_manager.commit_full_blocks", "all computed", "commit_uncomputed")
def commit_uncomputed_blocks(self, req):
    """Names every full block of the table, computed or not."""
    _commit(self, req, computed=False)


@mistake("block_manager.commit_full_blocks", "chain the names", "commit_chain")
def commit_unchained(self, req):
    """Names each block from its own tokens (parent None every time)."""
    _commit(self, req, chain=False)


@mistake("block_manager.commit_full_blocks", "not only the newest", "commit_every_block")
def commit_last_block_only(self, req):
    """Names only the block the newest token filled: a step that fills several (a prompt, a chunk) names one."""
    if not self.enable_prefix_caching:
        return
    B = self.block_size
    i = min(req.num_computed_tokens, req.num_tokens) // B - 1
    if i < 0 or self.blocks[req.block_table[i]].hash is not None:
        return
    block = self.blocks[req.block_table[i]]
    parent = self.blocks[req.block_table[i - 1]].hash if i > 0 else None
    ids = tuple(req.token_ids[i * B:(i + 1) * B])
    block.hash, block.token_ids = self.hash_block(parent, ids), ids
    self.hash_to_block.setdefault(block.hash, block.block_id)


@mistake("block_manager.commit_full_blocks", "output tokens", "commit_output_ids")
def commit_prompt_ids(self, req):
    """Takes each block's ids from the prompt: a full block of output tokens gets a wrong name."""
    if not self.enable_prefix_caching:
        return
    B, parent = self.block_size, None
    for i in range(min(req.num_computed_tokens, req.num_tokens) // B):
        ids = tuple(req.prompt_token_ids[i * B:(i + 1) * B])
        parent = self.hash_block(parent, ids)
        block = self.blocks[req.block_table[i]]
        if block.hash is None:
            block.hash, block.token_ids = parent, ids
            self.hash_to_block.setdefault(parent, block.block_id)


@mistake("block_manager.commit_full_blocks", "all hold output tokens", "commit_output_blocks")
def commit_prompt_blocks_only(self, req):
    """Names the computed full blocks of the prompt only: a block that output tokens filled stays unnamed."""
    if not self.enable_prefix_caching:
        return
    B, parent = self.block_size, None
    for i in range(min(req.num_computed_tokens, req.num_prompt_tokens) // B):
        ids = tuple(req.token_ids[i * B:(i + 1) * B])
        parent = self.hash_block(parent, ids)
        block = self.blocks[req.block_table[i]]
        if block.hash is None:
            block.hash, block.token_ids = parent, ids
            self.hash_to_block.setdefault(parent, block.block_id)


@mistake("block_manager.recycle", "stays cached", "recycle_keep")
def recycle_frees_everything(self, block_id):
    """Frees every block: nothing is ever cached."""
    block = self.blocks[block_id]
    block.hash, block.token_ids = None, ()
    self.free_ids.append(block_id)


@mistake("block_manager.recycle", "not the front", "recycle_lru_end")
def recycle_to_the_front(self, block_id):
    """Puts a cached block at the least recently used end."""
    block = self.blocks[block_id]
    if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
        self.evictable[block_id] = None
        self.evictable.move_to_end(block_id, last=False)
    else:
        block.hash, block.token_ids = None, ()
        self.free_ids.append(block_id)


@mistake("block_manager.recycle", "leads to it", "recycle_duplicate")
def recycle_keeps_duplicates(self, block_id):
    """Caches any named block, also a duplicate no lookup can find."""
    block = self.blocks[block_id]
    if block.hash is not None:
        self.evictable[block_id] = None
    else:
        self.free_ids.append(block_id)


@mistake("block_manager.recycle", "forgets its name", "recycle_forget")
def recycle_frees_with_its_name(self, block_id):
    """Frees a block no lookup leads to but leaves its old name on it."""
    block = self.blocks[block_id]
    if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
        self.evictable[block_id] = None
    else:
        self.free_ids.append(block_id)


@mistake("block_manager.recycle", "goes to one place", "recycle_one_place")
def recycle_both_lists(self, block_id):
    """Caches a named block and also puts it on the free list."""
    block = self.blocks[block_id]
    if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
        self.evictable[block_id] = None
    else:
        block.hash, block.token_ids = None, ()
    self.free_ids.append(block_id)


@mistake("block_manager.evict", "another block than the least recently used", "evict_lru")
def evict_newest(self):
    """Evicts the most recently used block (injection test)."""
    block_id, _ = self.evictable.popitem(last=True)
    block = self.blocks[block_id]
    del self.hash_to_block[block.hash]
    block.hash, block.token_ids = None, ()
    return block_id


@mistake("block_manager.evict", "forget its name", "evict_forget")
def evict_keeps_the_name(self):
    """Takes the block out of the LRU list but leaves its name in hash_to_block."""
    block_id, _ = self.evictable.popitem(last=False)
    return block_id


@mistake("block_manager.evict", "out of self.evictable", "evict_unlist")
def evict_leaves_it_listed(self):
    """Reads the front of self.evictable (next(iter(...))) without removing it."""
    block_id = next(iter(self.evictable))
    block = self.blocks[block_id]
    del self.hash_to_block[block.hash]
    block.hash, block.token_ids = None, ()
    return block_id
