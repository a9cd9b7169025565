"""The scheduler: the queues, and the admission and preemption code every scheduling policy shares.

`schedule()` runs the policy `EngineConfig.scheduler` names; each lives in its own module of
`lab_utils/engine/scheduling/`, bound here as a method:

- `static` (`scheduling/static.py`): admit a batch together; nobody joins until every member has finished.
- `continuous` (`scheduling/continuous.py`): finished requests leave and waiting ones join at every step (Orca),
  prefill-first as in nano-vllm. (Lab 01.)
- `token_budget` (`scheduling/chunked_prefill.py`): vLLM V1's step with chunked prefill: running requests first,
  then (chunks of) new prompts, within `max_num_batched_tokens`. (Lab 03.)
When blocks run out, the newest running request is preempted (recompute: drop its KV; swap: copy it to host).

The methods a learner rewrites (`schedule_continuous`, `make_room`, `preempt`, `schedule_token_budget`) are the
parts named in `lab_utils.course.parts`; with a learner part in the engine, `schedule()` checks whatever a policy returns before the engine runs it
(`lab_utils.engine.invariants`), so a wrong policy fails with a message that names the mistake, not deep inside the
model.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from lab_utils.engine import invariants
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.replaceable import LearnerPartError
from lab_utils.engine.request import Request, Status
from lab_utils.engine.scheduling import chunked_prefill, continuous, static
from lab_utils.engine.scheduling.output import SchedulerOutput


class Scheduler:
    # True when learner parts run in this engine: every step a policy returns is checked before the model runs it
    # (`lab_utils.engine.invariants`); the course's `EngineParts.subclass` sets it
    guarded = False

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 swap_out: Callable[[Request], None] | None = None,
                 swap_in: Callable[[Request], None] | None = None) -> None:
        self.config, self.bm = config, block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # may still hold requests that ended since the last step: see retire
        self.swap_out, self.swap_in = swap_out, swap_in
        self.num_preemptions = 0
        self.static_quota = 0  # static batching: members of the current batch still to admit
        # speculative decoding: budget kept for each decode's guesses, so prefills do not crowd them out
        self.lookahead = config.speculative.num_speculative_tokens if config.speculative else 0
        self.static_batch_size = 0  # static batching: rows of the current batch (finished members pad it)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.running if not r.status.done)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        policy = {"static": self.schedule_static, "continuous": self.schedule_continuous,
                  "token_budget": self.schedule_token_budget}[self.config.scheduler]
        out = policy()
        if self.guarded:
            who = invariants.policy_name(policy)
            invariants.check_retired(self, who)
            self._check(out, who)
        return out

    # the policies, one module each (lab_utils/engine/scheduling/)
    schedule_static = static.schedule_static
    schedule_continuous = continuous.schedule_continuous
    schedule_token_budget = chunked_prefill.schedule_token_budget
    _continue_prefills = chunked_prefill.continue_prefills

    # -- pieces every policy uses ----------------------------------------------------------------------
    def _admit(self, out: SchedulerOutput, budget: int, limit: int | None = None) -> int:
        """Waiting requests join, first come first served, while a slot, the budget and the KV pool allow (and at
        most `limit` of them). Without chunked prefill a prompt that does not fit the budget whole waits."""
        admitted = 0
        while self.waiting and budget > 0 and self.num_running < self.config.max_num_seqs:
            if limit is not None and admitted == limit:
                break
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break  # without chunked prefill a prompt runs whole or waits
            if not self.can_start(req, n):
                break  # first come, first served: nobody overtakes the head of the queue
            n = self.start(req, n)
            out.scheduled.append((req, n))
            budget -= n
            admitted += 1
        return budget

    def _decode_all(self, out: SchedulerOutput) -> None:
        for req in list(self.running):
            if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
                out.scheduled.append((req, 1))

    # -- admission and memory -------------------------------------------------------------------------
    def can_start(self, req: Request, num_tokens: int) -> bool:
        """Can the head of the queue start with `num_tokens` more tokens now? The KV pool must hold them (keeping
        a small watermark of free blocks for running requests to grow into, unless nobody runs). Blocks that
        the prefix cache already holds for its prompt count as present."""
        if req.num_computed_tokens == 0 and req.status is Status.WAITING:
            cached = len(self.bm.match_prefix(req)) * self.bm.block_size
            num_tokens = min(num_tokens, req.num_tokens - cached)
        if self.bm.can_admit(req, num_tokens):
            return True
        need = self.bm.blocks_needed(req.num_computed_tokens + num_tokens) - len(req.block_table)
        return self.num_running == 0 and need <= self.bm.num_free_blocks

    def start(self, req: Request, num_tokens: int) -> int:
        """Move the head of the queue into `running` with blocks for `num_tokens` more tokens. Returns the number
        of tokens it computes this step: fewer when the prefix cache already holds part of its prompt."""
        if not self.waiting or self.waiting[0] is not req:
            raise LearnerPartError(f"start({req.request_id}) takes the head of the waiting queue, self.waiting[0] "
                                   f"(first come, first served), not another request")
        self.waiting.popleft()
        if req.num_computed_tokens == 0 and req.status is Status.WAITING:
            self.bm.admit(req)  # attaches cached prefix blocks, advances num_computed_tokens past them
            num_tokens = min(num_tokens, req.num_tokens - req.num_computed_tokens)
        swapped = req.status is Status.SWAPPED
        ok = self.bm.grow(req, req.num_computed_tokens + num_tokens)
        if not ok:
            raise LearnerPartError(
                f"could not allocate blocks for {req} although the admission check said it fits: grow() "
                f"and can_admit() disagree (free blocks: {self.bm.num_free_blocks})")
        if swapped:
            self.swap_in(req)
        req.status = Status.RUNNING
        self.running.append(req)
        return num_tokens

    def make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow `req`'s block table to cover `num_tokens` tokens, preempting the newest running request until it
        fits. False when `req` itself had to give way (it is then back in the queue)."""
        while not self.bm.grow(req, num_tokens):
            victim = self.running[-1]  # the newest request gives way: it has the least work to lose
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Take a running request off the batch. Recompute (the default): drop its KV and send it to the front
        of the queue to start over; swap: copy its KV to host memory first and keep its progress."""
        self.running.remove(req)
        self.num_preemptions += 1
        req.metrics.preemptions += 1
        if self.config.preemption_mode == "swap" and self.swap_out is not None:
            self.swap_out(req)  # copies KV to host; keeps num_computed_tokens
            self.bm.free(req)
            req.status = Status.SWAPPED
        else:
            self.bm.free(req)
            req.num_computed_tokens = 0  # recompute from scratch (the prefix cache may still help)
            req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: Status) -> None:
        """A request ended: free its blocks now; the next `schedule()` retires it from `running`."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        req.swapped_kv = None
        req.status = status

    # -- the guard between a policy and the engine -------------------------------------------------
    def _check(self, out: SchedulerOutput, policy: str) -> None:
        """Everything the model runner relies on (`invariants.check_step`)."""
        invariants.check_step(self, out, policy)
