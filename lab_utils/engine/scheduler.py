"""Who runs this step, and how many of their tokens.

Every policy returns the same thing: a list of (request, number of tokens to compute). A prefill chunk is
"n prompt tokens", a decode is "1 token", so one forward pass can mix them.

- `static`:       admit a batch together; nobody joins until every member has finished (the old baseline).
                  A finished member stays in the batch as a padding row until the whole batch ends: every
                  decode step runs at the batch's full size (`SchedulerOutput.num_padding` rows whose outputs
                  are thrown away). That is what static batching costs in the papers' baseline (Orca's
                  FasterTransformer) and in Hugging Face `generate` with padding: the batch is one tensor, and
                  a finished row keeps computing until the longest row stops.
- `continuous`:   finished requests leave and waiting ones join at every step (Orca); prefill-first, as in
                  nano-vllm: a step is either all prefill (whole prompts) or all decode. (Lab 01.)
- `token_budget`: vLLM V1: each step first gives every running request its next token(s), oldest first (decodes,
                  and the next chunk of a prompt still being prefilled), then fills the rest of
                  `max_num_batched_tokens` with (chunks of) waiting prompts, in one mixed batch. (Lab 03.)
When blocks run out, the newest running request is preempted (recompute: drop its KV; swap: copy it to host).

The methods a learner rewrites (`schedule_continuous`, `make_room`, `preempt`, `schedule_token_budget`) are the
parts named in `lab_utils.course.parts`; `schedule()` checks whatever a policy returns before the engine runs it,
so a wrong policy fails with a message that names the mistake, not deep inside the model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from lab_utils.engine.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.course.parts import LearnerPartError
from lab_utils.engine.request import Request, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_padding: int = 0  # static batching: rows of finished members still computed (outputs discarded)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _whose(policy: Callable) -> str:
    """A policy's name in messages: a learner's step is named with its lab and the file it is saved in."""
    name = getattr(policy, "__learner_part__", None)
    if name is None:
        return policy.__name__
    from lab_utils.course.parts import PARTS
    from lab_utils.course.learner_parts import learner_dir

    part = PARTS[name]
    return f"your {name} (lab {part.lab}, {learner_dir().name}/{part.component}.py)"


class Scheduler:
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
        who = _whose(policy)
        stale = [r.request_id for r in self.running if r.status.done]
        if stale:
            raise LearnerPartError(f"{who}: requests {stale} had ended but are still in self.running: "
                                   f"retire finished requests (status.done) at the start of the step")
        self._check(out, who)
        return out

    def schedule_continuous(self) -> SchedulerOutput:
        """Continuous batching, prefill-first: retire the finished, admit waiting prompts first come first served
        while a slot, the step's token budget and the KV pool allow; a step that runs no prompt decodes every
        running request. (With chunked prefill a long prompt runs in chunks of the budget, one per step.)"""
        out = SchedulerOutput()
        self.running = [r for r in self.running if not r.status.done]  # retire: finished requests leave
        budget = self._continue_prefills(out, self.config.max_num_batched_tokens)
        self._admit(out, budget)
        if not out.scheduled:
            self._decode_all(out)
        return out

    def schedule_token_budget(self) -> SchedulerOutput:
        """vLLM V1's unified token budget with chunked prefill: running requests first, oldest first (a decode
        takes 1 token, an unfinished prompt its next chunk), then new prompts fill what is left of the budget."""
        out = SchedulerOutput()
        self.running = [r for r in self.running if not r.status.done]
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.make_room(req, req.num_computed_tokens + n, out):
                out.scheduled.append((req, n))
                budget -= n
        # speculative decoding (lab 07): keep room in the step for each decode's guesses
        budget -= self.lookahead * sum(1 for r, n in out.scheduled if n == 1 and not r.is_prefill)
        if not out.preempted:  # memory is short: no newcomer this step
            self._admit(out, budget)
        return out

    def schedule_static(self) -> SchedulerOutput:
        """Static batching: a batch is admitted together and nobody joins until all of it has finished."""
        out = SchedulerOutput()
        self.running = [r for r in self.running if not r.status.done]
        if not self.running and self.static_quota == 0:
            self.static_quota = self.static_batch_size = min(len(self.waiting), self.config.max_num_seqs)
        budget = self._continue_prefills(out, self.config.max_num_batched_tokens)
        if self.static_quota > 0:
            self._admit(out, budget)
        if not out.scheduled:
            self.static_quota = 0  # the batch could not grow further: it is closed
            self._decode_all(out)
            out.num_padding = max(0, self.static_batch_size - len(out.scheduled))
        return out

    # -- pieces of the reference policies ----------------------------------------------------------
    def _continue_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests whose prompt is not yet computed (chunked prefill, or a recompute) get their next chunk."""
        for req in list(self.running):
            remaining = req.num_tokens - req.num_computed_tokens
            if budget <= 0 or req.status is not Status.RUNNING or (remaining == 1 and not req.is_prefill):
                continue
            n = min(remaining, budget)
            if self.make_room(req, req.num_computed_tokens + n, out):
                out.scheduled.append((req, n))
                budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting requests join, first come first served, while a slot, the budget and the KV pool allow."""
        while self.waiting and budget > 0 and self.num_running < self.config.max_num_seqs:
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
            if self.config.scheduler == "static":
                self.static_quota -= 1
                if self.static_quota == 0:
                    break
        return budget

    def _decode_all(self, out: SchedulerOutput) -> None:
        for req in list(self.running):
            if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
                out.scheduled.append((req, 1))

    # -- admission and memory (helpers every policy uses) ------------------------------------------
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
        """Everything the model runner relies on, checked on every step (cheap: one pass over the batch)."""
        cfg, seen = self.config, set()

        def fail(msg: str) -> None:
            raise LearnerPartError(f"{policy}: {msg}")

        if len(self.running) > cfg.max_num_seqs:
            fail(f"{len(self.running)} requests are running but max_num_seqs is {cfg.max_num_seqs}: admit only "
                 f"while len(self.running) < max_num_seqs")
        if out.num_tokens > cfg.max_num_batched_tokens:
            fail(f"the step has {out.num_tokens} tokens but the budget (max_num_batched_tokens) is "
                 f"{cfg.max_num_batched_tokens}")
        for req, n in out.scheduled:
            if id(req) in seen:
                fail(f"{req.request_id} is scheduled twice in one step")
            seen.add(id(req))
            if req.status.done:
                fail(f"{req.request_id} has already {req.status.value} but was scheduled: retire finished "
                     f"requests (status.done) from self.running before scheduling")
            if req.status is not Status.RUNNING or req not in self.running:
                fail(f"{req.request_id} is scheduled but is {req.status.value}, not in self.running: admit "
                     f"with self.start(req, n), which moves it from the queue into the batch")
            remaining = req.num_tokens - req.num_computed_tokens
            if not 1 <= n <= remaining:
                fail(f"{req.request_id} is scheduled for {n} tokens but has {remaining} left to compute "
                     f"(a decode is 1; a prompt chunk is at most what is left)")
            if len(req.block_table) * self.bm.block_size < req.num_computed_tokens + n:
                fail(f"{req.request_id} is scheduled for {n} tokens but its blocks hold only "
                     f"{len(req.block_table) * self.bm.block_size} of the {req.num_computed_tokens + n} needed: "
                     f"grow its block table first (self.make_room / self.bm.grow)")
        order = [r for r in self.waiting]
        if any(r.status is Status.RUNNING for r in order):
            fail("a request in the waiting queue is marked RUNNING")
