"""Who runs this step, and how many of their tokens.

Every policy returns the same thing: a list of (request, number of tokens to compute). A prefill chunk is
"n prompt tokens", a decode is "1 token", so one forward pass can mix them.

- `static`:       admit a batch together; nobody joins until every member has finished (the old baseline).
                  A finished member stays in the batch as a padding row until the whole batch ends: every
                  decode step runs at the batch's full size (`SchedulerOutput.num_padding` rows whose outputs
                  are thrown away). That is what static batching costs in the papers' baseline (Orca's
                  FasterTransformer) and in Hugging Face `generate` with padding: the batch is one tensor, and
                  a finished row keeps computing until the longest row stops. Letting finished members leave
                  would make static steps cheaper and understate what continuous batching saves.
- `continuous`:   finished requests leave and waiting ones join at every step (Orca); prefill-first, as in
                  nano-vllm: a step is either all prefill or all decode.
- `token_budget`: vLLM V1: each step first gives every running request its next token(s), then fills the rest
                  of `max_num_batched_tokens` with (chunks of) waiting prompts, in one mixed batch.
When blocks run out, the newest running request is preempted (recompute: drop its KV; swap: copy it to host).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from lab_utils.engine.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.request import Request, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_padding: int = 0  # static batching: rows of finished members still computed (outputs discarded)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 swap_out: Callable[[Request], None] | None = None,
                 swap_in: Callable[[Request], None] | None = None) -> None:
        self.config, self.bm = config, block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swap_out, self.swap_in = swap_out, swap_in
        self.num_preemptions = 0
        self.static_quota = 0  # static batching: members of the current batch still to admit
        # speculative decoding: budget kept for each decode's guesses, so prefills do not crowd them out
        self.lookahead = config.speculative.num_speculative_tokens if config.speculative else 0
        self.static_batch_size = 0  # static batching: rows of the current batch (finished members pad it)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the policies -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        policy = self.config.scheduler
        budget = self.config.max_num_batched_tokens
        if policy == "token_budget":
            budget = self._schedule_running(out, budget, decodes=True, prefills=True)
            budget -= self.lookahead * sum(1 for r, n in out.scheduled if n == 1 and not r.is_prefill)
            if not out.preempted:
                self._schedule_waiting(out, budget)
            return out
        if policy == "static" and not self.running and self.static_quota == 0:
            self.static_quota = self.static_batch_size = min(len(self.waiting), self.config.max_num_seqs)
        # prefill-first: a prefill step if any prompt work is possible, else a decode step
        budget = self._schedule_running(out, budget, decodes=False, prefills=True)
        if policy == "continuous" or self.static_quota > 0:
            self._schedule_waiting(out, budget)
        if policy == "static" and not out.scheduled:
            self.static_quota = 0  # the batch could not grow further: it is closed
        if not out.scheduled:
            self._schedule_running(out, self.config.max_num_batched_tokens, decodes=True, prefills=False)
            if policy == "static":
                out.num_padding = max(0, self.static_batch_size - len(out.scheduled))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, decodes: bool, prefills: bool) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            is_decode = remaining == 1 and not req.is_prefill
            if (is_decode and not decodes) or (not is_decode and not prefills):
                i += 1
                continue
            n = min(remaining, budget)
            while not self.bm.grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]  # the newest request gives way
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0 and req.status is Status.WAITING
            cached = len(self.bm.match_prefix(req)) * self.bm.block_size if fresh else 0
            remaining = req.num_tokens - max(req.num_computed_tokens, cached)
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.bm.can_admit(req, n) and (self.running or not self._fits_alone(req, n)):
                break
            self.waiting.popleft()
            if fresh:
                self.bm.admit(req)
                n = min(req.num_tokens - req.num_computed_tokens, budget)
            swapped = req.status is Status.SWAPPED
            ok = self.bm.grow(req, req.num_computed_tokens + n)
            assert ok, "admission check and allocation disagree"
            if swapped:
                self.swap_in(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
            if self.config.scheduler == "static":
                self.static_quota -= 1
                if self.static_quota == 0:
                    break
        return budget

    def _fits_alone(self, req: Request, n: int) -> bool:
        """With nothing running the watermark protects no one: admit if the blocks exist at all."""
        need = self.bm.blocks_needed(req.num_computed_tokens + n) - len(req.block_table)
        return need <= self.bm.num_free_blocks

    # -- preemption and completion ----------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
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
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        req.swapped_kv = None
        req.status = status
