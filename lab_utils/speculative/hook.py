"""Speculative decoding inside the engine: a decode step becomes a verify step.

For each decoding request, `plan` asks the proposer for up to k guesses, appends them to the request's
tokens for the length of one step, and grows its block table so that the target computes the last token plus
the k guesses (k+1 rows) in the same forward pass as everyone else (paged KV, mixed with prefill chunks).
`verify` then keeps the longest prefix the target agrees with (`verify.py`), removes the guesses from the
request again, and rolls back: `num_computed_tokens` drops to the verified tokens (the rejected guesses' KV
slots are simply overwritten later) and blocks that only held rejected guesses go back to the pool. The
engine appends the accepted tokens + the correction/bonus token with its usual stop checks, and commits to the
prefix cache only after the rollback, so only blocks of verified tokens are ever shared.

The walk (`accept_reject`, with its `residual`), the greedy `verify_greedy` and the `rollback` are lab 07's parts: `SpecDecoder` takes the
learner's versions from the engine's `EngineParts`.

Limits, on purpose: one chain per request (no tree attention); guesses never cause preemption (if the blocks
are not free, that request decodes normally this step); guesses stay inside the step's token budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab_utils.engine.hooks import StepBatch, StepHook
from lab_utils.engine.kv.paging import slot
from lab_utils.engine.request import Request
from lab_utils.engine.sampler import apply_top_k_top_p, sample
from lab_utils.speculative import make_proposer
from lab_utils.speculative.base import Proposal
from lab_utils.speculative.verify import accept_reject, verify_greedy, verify_sampling


@dataclass
class SpecStats:
    k: int
    num_verify_steps: int = 0  # request-steps that verified >= 1 guess
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # accepted + correction/bonus tokens, over verify steps
    proposed_at: list[int] = field(default_factory=list)  # per position i: guesses made at depth i
    accepted_at: list[int] = field(default_factory=list)  # per position i: guesses kept at depth i

    def __post_init__(self) -> None:
        self.proposed_at = [0] * self.k
        self.accepted_at = [0] * self.k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        for i in range(num_proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def as_dict(self) -> dict:
        rate = self.num_accepted / self.num_proposed if self.num_proposed else None
        return {
            "spec_acceptance_rate": rate,
            "spec_acceptance_per_position": [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "spec_mean_tokens_per_step": self.num_emitted / self.num_verify_steps if self.num_verify_steps else None,
            "spec_mean_accepted_per_step": self.num_accepted / self.num_verify_steps if self.num_verify_steps else None,
            "spec_num_proposed": self.num_proposed,
            "spec_num_accepted": self.num_accepted,
            "spec_num_verify_steps": self.num_verify_steps,
        }


def rollback(req: Request, block_manager, num_guesses: int, num_accepted: int) -> None:
    """After a verify step: take the guesses back out of the request, uncount the rejected ones (their KV slots
    are garbage, overwritten later) and give back the blocks past the verified tokens + the one this step adds."""
    del req.token_ids[len(req.token_ids) - num_guesses:]
    req.num_computed_tokens -= num_guesses - num_accepted
    keep = block_manager.blocks_needed(req.num_computed_tokens + 1)
    for bid in reversed(req.block_table[keep:]):  # last block first, as `free` does
        block_manager.release(bid)
    del req.block_table[keep:]


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The target's sampling distribution at each row, exactly as the non-speculative sampler would use it."""
    rows = [apply_top_k_top_p(row.float() / params.temperature, params.top_k, params.top_p) for row in logits]
    return torch.stack(rows).softmax(-1).cpu()


class SpecDecoder(StepHook):
    """The engine's speculative-decoding hook: `plan` adds guesses to decodes, `pick` verifies them."""

    def __init__(self, spec_config, model, device, block_manager, max_model_len: int, kv_cache=None,
                 parts=None, engine_config=None) -> None:
        self.config, self.k = spec_config, spec_config.num_speculative_tokens
        # a self-draft: lab 05's parts; a draft model: the engine's CPU switches
        self.proposer = make_proposer(spec_config, model, device, parts=parts, engine_config=engine_config)
        self.bm, self.max_model_len, self.kv_cache = block_manager, max_model_len, kv_cache
        self.stats = SpecStats(self.k)
        self.hidden: dict[str, torch.Tensor] = {}  # per request: rows promised by the `hidden` contract (base.py)
        # lab 07's parts: None = the reference walk (and the fast greedy path); else the learner's
        walk = parts.function("spec.accept_reject", None) if parts is not None else None
        mine = parts.function("spec.residual", None) if parts is not None else None
        if walk is None and mine is not None:  # only the residual is the learner's: the reference walk uses it
            def walk(p, q, draft, u):
                return accept_reject(p, q, draft, u, residual=mine)
        self.walk = walk
        self.greedy = parts.function("spec.verify_greedy", None) if parts is not None else None
        self.rollback = parts.function("spec.rollback", rollback) if parts is not None else rollback

    # -- the step hook ------------------------------------------------------------------------------
    def plan(self, batch: StepBatch) -> None:
        """Add guesses to this step's decodes: `batch.guesses` and, per scheduled entry, `batch.rows`."""
        batch.guesses, batch.rows = self.propose_all(batch.scheduled, batch.budget_left, batch.filter_guesses)

    def pick(self, batch: StepBatch) -> list[list[int]]:
        """Verify this step's guesses: the accepted ones and one more token per request."""
        return self.verify(batch.guesses, batch.logits, batch.hidden, batch.to_sample, batch.sampled_rows())

    def engine_stats(self) -> dict:
        return self.stats.as_dict()

    # -- guesses and verification ------------------------------------------------------------------
    def propose_all(self, scheduled: list[tuple[Request, int]], budget: int,
                    filter_guesses=None) -> tuple[dict[str, Proposal], list[int]]:
        """Add guesses to this step's decodes (in place). Returns {request id: proposal} and, per scheduled
        entry, how many trailing rows of logits the runner must return (1 + guesses for a verify).
        `filter_guesses(req, proposal)` may cut a proposal (structured output: guesses its grammar refuses)."""
        plans, rows = {}, []
        for i, (req, n) in enumerate(scheduled):
            # a request with logit processors decodes one token at a time: its penalties depend on every token
            # before, so the target's rows for later guesses would be scored without the guesses before them
            is_decode = (n == 1 and req.num_computed_tokens == req.num_tokens - 1 and not req.is_prefill
                         and not req.params.processes_logits)
            k = min(self.k, budget, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1) if is_decode else 0
            prop = self._propose(req, k) if k > 0 else None
            if prop is not None and filter_guesses is not None:
                prop = filter_guesses(req, prop)
            if prop is not None and prop.token_ids and self.bm.grow(req, req.num_tokens + len(prop.token_ids)):
                req.token_ids.extend(prop.token_ids)  # only for this step: `verify` removes them again
                scheduled[i] = (req, 1 + len(prop.token_ids))
                budget -= len(prop.token_ids)
                plans[req.request_id] = prop
            rows.append(len(plans[req.request_id].token_ids) + 1 if req.request_id in plans else 1)
        return plans, rows

    def _propose(self, req: Request, k: int) -> Proposal:
        p = self.proposer
        p.request_id = req.request_id
        hidden = self.hidden.get(req.request_id) if p.needs_hidden else None
        if p.needs_hidden and hidden is None:
            return Proposal([])  # e.g. right after a swap-in: one plain step brings the hidden state back
        if p.shares_target_kv and self.kv_cache is not None:
            p.target_kv = (req.num_computed_tokens, lambda start, end: self._target_kv(req, start, end))
        prop = p.propose(list(req.token_ids), k, hidden=hidden, temperature=req.params.temperature)
        if len(prop.token_ids) > k:
            prop = Proposal(prop.token_ids[:k], None if prop.probs is None else prop.probs[:k])
        return prop

    def _target_kv(self, req: Request, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's K/V of the request's tokens start..end-1, read from the paged cache (any KV dtype)."""
        cache, bs = self.kv_cache, self.kv_cache.block_size
        slots = slot(torch.tensor(req.block_table), torch.arange(start, end), bs).to(cache.k.device)
        return [cache.read(layer, slots) for layer in range(cache.num_layers)]

    def verify(self, plans: dict[str, Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
               to_sample: list[Request], rows: list[int]) -> list[list[int]]:
        """Per request in `to_sample`: the tokens to append (1 for a plain decode/prefill, accepted + 1 for a
        verify). Rolls verified requests back to their verified tokens (tokens, computed count, blocks)."""
        out: list[list[int] | None] = [None] * len(to_sample)
        plain, plain_rows = [], []
        r = 0
        for j, (req, n_rows) in enumerate(zip(to_sample, rows)):
            prop = plans.get(req.request_id)
            if prop is None:
                plain.append(j)
                plain_rows.append(r)
            else:
                out[j] = self._verify_one(req, prop, logits[r:r + n_rows])
            if self.proposer.needs_hidden and hidden is not None:
                kept = 1 if prop is None else len(out[j])  # rows that produced kept tokens (see base.py)
                self.hidden[req.request_id] = hidden[r:r + kept]
            r += n_rows
        if plain:
            reqs = [to_sample[j] for j in plain]
            toks = sample(logits[plain_rows], [q.params for q in reqs], [q.generator for q in reqs])
            for j, tok in zip(plain, toks):
                out[j] = [tok]
        return out

    def _verify_one(self, req: Request, prop: Proposal, logits: torch.Tensor) -> list[int]:
        guesses = prop.token_ids
        if req.params.greedy and self.greedy is not None:
            toks = [int(t) for t in self.greedy(logits, list(guesses))]
        elif req.params.greedy:
            toks = verify_greedy(logits, guesses, self.walk)
        else:
            toks = verify_sampling(target_probs(logits, req.params), guesses, prop.probs, req.generator, self.walk)
        accepted = len(toks) - 1
        if not 0 <= accepted <= len(guesses) or toks[:accepted] != list(guesses[:accepted]):
            from lab_utils.engine.replaceable import LearnerPartError

            raise LearnerPartError(f"the verify step returned {toks} for the guesses {list(guesses)}: the kept guesses "
                                   f"(0..{len(guesses)} of them, in order) and then one token")
        self.rollback(req, self.bm, len(guesses), accepted)  # KV of the rejected guesses is now garbage
        self.stats.record(len(guesses), accepted)
        self.proposer.on_accept(req.request_id, accepted)
        return toks

    def release(self, request_id: str) -> None:
        self.hidden.pop(request_id, None)
        self.proposer.release(request_id)
