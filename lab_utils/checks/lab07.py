"""Checks for lab 07's exercises: the residual distribution, the accept/reject step of speculative sampling, and
the rollback of a verified request (its guesses out, its rejected tokens uncounted, their blocks freed).

The first two are checked on fresh random distributions against `lab_utils.speculative.verify`, with the uniforms given,
so a result is either right or wrong (no sampling noise); the rollback on random engine states against
`lab_utils.speculative.hook.rollback`. On a mismatch the message says which input, what was expected and what
came back, and names the rule that was missed when it can tell. It never shows the reference. All three are engine
parts: once checked, the lab submits them, and `check_verify_in_engine` runs the engine's verify step with them
(a chi-square test of its sampled output, and the real engine's greedy and seeded-sampled tokens).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lab_utils.checks.claims import Claim
from lab_utils.checks.part_named import checks_part
from lab_utils.speculative.verify import accept_probability, residual_distribution


def _pq(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    return p / p.sum(), q / q.sum()


def _seed(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))


# --- exercise 1: the residual ----------------------------------------------------------------------------------
def _residual_hint(p, q, got, expected) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"return a tensor of shape {tuple(expected.shape)}"
    if (got < -1e-9).any():
        return "a probability cannot be negative: clamp p - q at 0 (max(0, p - q))"
    if abs(float(got.sum()) - 1) > 1e-6:
        return "the residual must be normalised to sum to 1"
    if torch.allclose(got, p, atol=1e-9):
        return "you returned p: after a rejection the draw must come from max(0, p - q), normalised"
    flipped = torch.clamp(q - p, min=0)
    if flipped.sum() > 0 and torch.allclose(got.double(), (flipped / flipped.sum()).double(), atol=1e-6):
        return "that is max(0, q - p): the residual is the target's excess over the draft, max(0, p - q)"
    return ("the residual puts mass only where p > q, in proportion to p - q (normalised); where p <= q it is 0: "
            f"yours has {int(((got > 1e-9) & (p <= q)).sum())} such token(s) above 0")


@checks_part("spec.residual")
def check_residual(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seed: int | None = None) -> None:
    """`fn(p [V], q [V]) -> r [V]`: max(0, p - q) normalised; p itself when p == q (nothing to correct)."""
    gen = _seed(seed)
    cases = [_pq(gen, int(torch.randint(2, 40, (), generator=gen))) for _ in range(30)]
    p0 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    cases += [(p0, p0.clone()), (p0, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))]
    for p, q in cases:
        expected = residual_distribution(p, q)
        got = fn(p.clone(), q.clone())
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.allclose(got.double(), expected, atol=1e-6):
            continue
        hint = "when p == q, max(0, p - q) is all zeros: fall back to p" if torch.equal(p, q) else \
            _residual_hint(p, q, got, expected)
        raise AssertionError(f"residual(p={p.tolist()}, q={q.tolist()})\n   returned {got}\n   expected {expected}"
                             + (f"\n   hint: {hint}" if hint else ""))
    print(f"check_residual passed: {len(cases)} (p, q) pairs, including p == q")
    from lab_utils.course import learner_parts

    learner_parts.submit("spec.residual", fn)


# --- exercise 2: accept / reject -------------------------------------------------------------------------------
def reference_accept_reject(p: torch.Tensor, q: torch.Tensor, draft: list[int], u: list[float]
                            ) -> tuple[int, torch.Tensor]:
    for i, x in enumerate(draft):
        if not u[i] < accept_probability(p[i], q[i], x):
            return i, residual_distribution(p[i], q[i])
    return len(draft), p[len(draft)]


@checks_part("spec.accept_reject")
def check_accept_reject(fn: Callable, seed: int | None = None, cases: int = 60) -> None:
    """`fn(p [k+1, V], q [k, V], draft [k], u [k]) -> (n_accepted, dist [V])`: walk the draft left to right,
    keep token i while u[i] < min(1, p_i(x_i) / q_i(x_i)); return how many were kept and the distribution the
    next token comes from (the residual at the first rejection, p_k after a full accept)."""
    gen = _seed(seed)
    for c in range(cases):
        k, V = int(torch.randint(1, 6, (), generator=gen)), int(torch.randint(3, 12, (), generator=gen))
        pq = [_pq(gen, V) for _ in range(k + 1)]
        p, q = torch.stack([a for a, _ in pq]), torch.stack([b for _, b in pq])[:k]
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        ratio = [accept_probability(p[i], q[i], x) for i, x in enumerate(draft)]
        # uniforms just below / above each threshold (and all-accept cases), so every branch is decided
        u = [min(max(r + (0.02 if torch.rand(1, generator=gen) < 0.4 else -0.02), 0.0), 0.999) for r in ratio]
        if c % 5 == 0:
            u = [0.0] * k
        n_exp, d_exp = reference_accept_reject(p, q, draft, u)
        got = fn(p.clone(), q.clone(), list(draft), list(u))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"return a tuple (n_accepted, dist), got {type(got).__name__}")
        n_got, d_got = got
        where = f"p_x/q_x = {[round(r, 3) for r in ratio]}, u = {[round(x, 3) for x in u]}"
        if n_got != n_exp:
            hint = "accept while u < min(1, p(x)/q(x)); stop at the first rejection" if n_got > n_exp else \
                "min(1, p(x)/q(x)) is the acceptance probability: accept when u is BELOW it (p(x) >= q(x) always accepts)"
            raise AssertionError(f"case {c}: {where}\n   n_accepted: expected {n_exp}, got {n_got}\n   hint: {hint}")
        if not (isinstance(d_got, torch.Tensor) and d_got.shape == d_exp.shape
                and torch.allclose(d_got.double(), d_exp.double(), atol=1e-6)):
            if n_exp == k:
                hint = f"all {k} accepted: the bonus token comes from p[k], the row after the last draft token"
            elif isinstance(d_got, torch.Tensor) and d_got.shape == d_exp.shape and torch.allclose(d_got.double(), p[n_exp].double()):
                hint = "after a rejection draw from the residual max(0, p - q), not from p"
            else:
                hint = f"after rejecting position {n_exp}, use the residual of p[{n_exp}] and q[{n_exp}]"
            raise AssertionError(f"case {c}: {where}\n   dist: expected {d_exp.tolist()}\n   got {d_got}\n   hint: {hint}")
    print(f"check_accept_reject passed: {cases} chains (full accepts, early and late rejections)")
    from lab_utils.course import learner_parts

    learner_parts.submit("spec.accept_reject", fn)


VERIFY_PARTS = ("spec.residual", "spec.accept_reject", "spec.verify_greedy", "spec.rollback")  # lab 07's parts


# --- exercise 3: greedy verify ---------------------------------------------------------------------------------
@checks_part("spec.verify_greedy")
def check_verify_greedy(fn: Callable, cases: int = 80, seed: int | None = None) -> None:
    """`fn(logits [k+1, V], draft [k]) -> tokens`: keep guess i while it equals the argmax of row i, stop at the
    first that does not and append that row's argmax (the correction); all kept: append row k's argmax (the bonus)."""
    from lab_utils.speculative.verify import verify_greedy

    gen = _seed(seed)
    for c in range(cases):
        k, V = int(torch.randint(1, 6, (), generator=gen)), int(torch.randint(3, 30, (), generator=gen))
        logits = torch.randn(k + 1, V, generator=gen)
        best = logits.argmax(-1).tolist()
        stop = int(torch.randint(0, k + 1, (), generator=gen))  # guesses before it agree, the one at it does not
        draft = [best[i] if i < stop else (best[i] + 1 + int(torch.randint(0, V - 1, (), generator=gen))) % V
                 for i in range(k)]
        if c % 4 == 0:  # some later guesses agree again after a mismatch: the walk must have stopped
            draft = [best[i] if i != stop else draft[i] for i in range(k)]
        want = verify_greedy(logits.clone(), list(draft))
        got = fn(logits.clone(), list(draft))
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            raise AssertionError(f"case {c}: return a list of token ids, got {type(got).__name__}") from None
        if got == want:
            continue
        n = len(want) - 1
        if n == k and got == want[:-1]:
            hint = f"all {k} guesses were kept: append the bonus token, the argmax of the last row (logits[{k}])"
        elif len(got) == len(want) and got[:-1] == want[:-1] and got[-1] == draft[min(n, k - 1)]:
            hint = "at the first mismatch append the target's argmax there (the correction), not the rejected guess"
        elif len(got) > len(want) and got[:len(want)] == want:
            hint = "stop at the first guess that is not the argmax: later guesses were made after a wrong token"
        elif got[:n] == want[:n] and len(got) == len(want):
            hint = "row i of the logits scores guess i (row 0 is the last real token's): compare guess i with row i"
        else:
            hint = "keep guess i while it equals logits[i].argmax(), then append the argmax of the row where you stopped"
        raise AssertionError(f"case {c}: argmax per row {best}, guesses {draft}\n   returned {got}\n   expected {want}"
                             f"\n   hint: {hint}")
    print(f"check_verify_greedy passed: {cases} chains (all kept, early and late mismatches)")
    from lab_utils.course import learner_parts

    learner_parts.submit("spec.verify_greedy", fn)


# --- exercise 4: the rollback ----------------------------------------------------------------------------------
def _verified_state(seed: int, zero_guesses: bool = False):
    """A scheduler mid-run (lab 01-04's random states) and one running request right after a verify step: k
    guesses appended, blocks grown for them, every row computed (k = 0 with `zero_guesses`: a proposer that found
    nothing to guess, as an n-gram proposer often does). None if no request can take guesses."""
    import random

    from lab_utils.checks.part_states import random_state

    sched = random_state(seed, "spec.rollback")
    rng = random.Random(seed)
    live = [r for r in sched.running if not r.status.done and r.num_computed_tokens == r.num_tokens - 1]
    if not live:
        return None
    req = live[rng.randrange(len(live))]
    k = 0 if zero_guesses else rng.randint(1, 5)
    if not sched.bm.grow(req, req.num_tokens + k):
        return None
    req.token_ids.extend(rng.randrange(100) for _ in range(k))
    req.num_computed_tokens = req.num_tokens
    return sched, req.request_id, k, rng.randint(0, k)


def _rollback_view(sched, rid: str) -> dict:
    from lab_utils.checks.part_states import snapshot

    req = next(r for r in sched.running if r.request_id == rid)
    return {"req.token_ids": list(req.token_ids), **snapshot(sched)}


@checks_part("spec.rollback")
def check_rollback(fn: Callable, cases: int = 150, seed: int = 0) -> None:
    """`fn(req, block_manager, num_guesses, num_accepted)`: after a verify step, remove the guesses from
    `req.token_ids`, lower `req.num_computed_tokens` by the rejected ones, and release the blocks past the verified
    tokens + 1. Compared with the engine's on random engine states."""
    import copy

    from lab_utils.speculative.hook import rollback

    done = 0
    for c in range(cases):
        state = _verified_state(seed * 100_000 + c, zero_guesses=c % 10 == 9)
        if state is None:
            continue
        sched, rid, k, n = state
        a, b = copy.deepcopy(sched), copy.deepcopy(sched)
        before = _rollback_view(sched, rid)
        rollback(next(r for r in a.running if r.request_id == rid), a.bm, k, n)
        try:
            fn(next(r for r in b.running if r.request_id == rid), b.bm, k, n)
        except NotImplementedError:
            raise
        except Exception as err:
            raise AssertionError(f"case {c}: your rollback raised {type(err).__name__}: {err}") from err
        want, got = _rollback_view(a, rid), _rollback_view(b, rid)
        if got == want:
            done += 1
            continue
        key = next(x for x in want if want[x] != got[x])
        req_b = next(r for r in b.running if r.request_id == rid)
        hints = {
            "req.token_ids": "take the num_guesses guesses off the end of req.token_ids (the engine appends the "
                             "accepted ones again, with the correction or bonus token)",
            "num_computed_tokens": "only the rejected guesses' KV is garbage: num_computed_tokens drops by "
                                   "num_guesses - num_accepted",
            "block_tables": "keep the blocks that cover num_computed_tokens + 1 tokens (the verified ones and the "
                            "token this step adds), give back the rest",
            "free blocks (free_ids)": "give each dropped block back with block_manager.release(block_id)",
            "ref_counts": "give each dropped block back with block_manager.release(block_id): its reference count "
                          "must drop",
        }
        hint = hints.get(key, "")
        if k == 0 and key == "req.token_ids" and not got[key]:
            hint = ("with num_guesses = 0 (nothing was guessed) nothing changes, but your rollback emptied "
                    "req.token_ids: a slice from the end, [-num_guesses:] or [:-num_guesses], is the whole list or "
                    "nothing when num_guesses is 0; count the cut from the front (len(req.token_ids) - num_guesses)")
        if key == "block_tables" and len(req_b.block_table) < len(before["block_tables"][rid]) and \
                want[key][rid][:len(got[key][rid])] == got[key][rid] and len(got[key][rid]) < len(want[key][rid]):
            hint = ("you dropped one block too many: the token this step adds (the correction or bonus) needs a slot "
                    "too, so keep blocks_needed(num_computed_tokens + 1)")
        raise AssertionError(f"rollback, case {c}: {k} guesses, {n} accepted; afterwards {key} is "
                             f"{got[key]!r}; expected {want[key]!r}"
                             + (f"\nlikely mistake: {hint}" if hint else "")
                             + f"\nthe request before: {len(before['req.token_ids'])} tokens, "
                               f"{before['num_computed_tokens'][rid]} computed, blocks {before['block_tables'][rid]}")
    print(f"check_rollback passed: {done} verified requests (0..k guesses kept, k = 0 included) rolled back as the "
          f"engine does")
    from lab_utils.course import learner_parts

    learner_parts.submit("spec.rollback", fn)


# --- the verify step in the engine ----------------------------------------------------------------------------
def check_verify_in_engine(parts, num_requests: int = 8, k: int = 3, seed: int = 0) -> dict:
    """The engine's verify step with `parts` (the walk, the residual, the rollback):
    1. its sampling verifier keeps the target's distribution: chi-square of the first and second emitted token
       over seeded draws from a poor draft, below the 0.001 critical value;
    2. the real engine on the tiny random model, its proposer a draft with other random weights (so guesses are
       often rejected), greedy and seeded sampling: the same tokens as with the engine's own verify step, the same
       number of guesses kept, every KV block back."""
    import random

    from lab_utils.engine.config import EngineConfig, SpecConfig
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.course.parts import EngineParts, LearnerPartError
    from lab_utils.engine.sampling_params import SamplingParams
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY
    from lab_utils.speculative.chi_square import CHI2_CRIT_DF5, verify_chi2
    from lab_utils.speculative.draft import DraftModelProposer

    walk = parts.function("spec.accept_reject", None)
    if walk is None and parts.is_learners("spec.residual"):
        from lab_utils.speculative.verify import accept_reject

        mine = parts.function("spec.residual", None)

        def walk(p, q, d, u):
            return accept_reject(p, q, d, u, residual=mine)
    try:
        c1, c2 = verify_chi2(walk)
    except LearnerPartError as err:
        raise AssertionError(f"the engine's sampling verifier with your parts stopped: {err}") from None
    assert c1 < CHI2_CRIT_DF5 and c2 < CHI2_CRIT_DF5, (
        f"with your accept/reject the engine's sampling verifier does not keep the target's distribution: "
        f"chi-square {c1:.1f} (first token) and {c2:.1f} (second) vs the 0.001 critical value {CHI2_CRIT_DF5} "
        f"(3000 seeded draws, a poor draft): after a rejection the token must come from the residual")
    rng = random.Random(seed)
    cfg = REGISTRY["tiny-random"].config
    model, other = build_random(cfg, seed=0).eval(), build_random(cfg, seed=7).eval()
    vocab = model.config.vocab_size
    prompts = []
    for _ in range(num_requests):
        base = [rng.randrange(100, vocab) for _ in range(rng.randint(3, 8))]
        prompts.append((base * 4)[: rng.randint(6, 24)])
    spec = SpecConfig("draft", k, model="tiny-random")
    results = {}
    for mode in ("greedy", "sampling"):
        params = [SamplingParams(max_tokens=rng.randint(6, 16), ignore_eos=True,
                                 **({"temperature": 1.0, "seed": i} if mode == "sampling" else {}))
                  for i in range(num_requests)]
        for who, p in (("reference", EngineParts()), ("yours", parts)):
            eng = LLMEngine((model, None), EngineConfig(speculative=SpecConfig("ngram", k), num_gpu_blocks=64,
                                                        block_size=4, max_num_seqs=4, max_num_batched_tokens=32),
                            device="cpu", parts=p)
            eng.spec.proposer = DraftModelProposer(spec, model, "cpu", draft_model=other)
            try:
                outs = eng.generate(prompts, params)
            except LearnerPartError as err:
                raise AssertionError(f"the engine ({mode}, speculative k={k}) with your parts stopped: {err}") from None
            try:
                eng.block_manager.check_all_free()
            except AssertionError as err:
                raise AssertionError(f"with your parts KV blocks leaked after every request ended: {err}") from None
            st = eng.stats()
            results[(mode, who)] = ([o.token_ids for o in outs], st["spec_num_accepted"], st["spec_num_proposed"],
                                    [s["free_blocks"] for s in eng.step_log])
        (ref_t, ref_a, ref_n, ref_f), (you_t, you_a, you_n, you_f) = results[(mode, "reference")], results[(mode, "yours")]
        bad = [i for i, (x, y) in enumerate(zip(ref_t, you_t)) if x != y]
        assert not bad, (f"{mode}: with your verify step the engine generated other tokens than with its own for "
                         f"{len(bad)} of {num_requests} requests (first: request {bad[0]}: {you_t[bad[0]][:8]}... vs "
                         f"{ref_t[bad[0]][:8]}...)")
        assert (you_a, you_n) == (ref_a, ref_n), (
            f"{mode}: your verify step kept {you_a} of {you_n} guesses, the engine's own {ref_a} of {ref_n} (the "
            f"tokens can still be right when a step yields fewer than it should, e.g. without its bonus token)")
        held = next((i for i, (x, y) in enumerate(zip(ref_f, you_f)) if x != y), None)
        assert held is None and len(ref_f) == len(you_f), (
            f"{mode}: after step {held} the engine with your parts had {you_f[held]} free KV blocks, with its own "
            f"{ref_f[held]}: blocks that only held rejected guesses go back to the pool at once" if held is not None
            else f"{mode}: the engine took {len(you_f)} steps with your parts, {len(ref_f)} with its own")
        assert 0 < ref_a < ref_n, f"{mode}: the workload must exercise both kept and rejected guesses ({ref_a}/{ref_n})"
    summary = {"chi2_first": c1, "chi2_second": c2,
               "accepted": {m: results[(m, "yours")][1] for m in ("greedy", "sampling")},
               "proposed": {m: results[(m, "yours")][2] for m in ("greedy", "sampling")}}
    print(f"the engine's verify step ran your parts: sampled output distributed as the target (chi-square {c1:.1f} "
          f"and {c2:.1f} < {CHI2_CRIT_DF5}); the real engine (tiny model, a disagreeing draft, k={k}) kept "
          + ", ".join(f"{summary['accepted'][m]}/{summary['proposed'][m]} guesses ({m})" for m in ("greedy", "sampling"))
          + ", tokens equal to its own verify step's, 0 blocks leaked")
    return summary


# --- the lab's closing claims --------------------------------------------------------------------------------

def claims(r: dict) -> list[Claim]:
    """Lab 07's claims from the run's measurements `r` (built in the notebook's claims cell).

    `gaps`: {config: [top-2 logit gap at each output that differs from plain greedy]}; `near_tie`: the largest
    gap rounding explains for the model's dtype (`teacher_forced.rounding_tie`); `acceptance` / `speedup`: per
    engine configuration of section 4."""
    from lab_utils.checks.claims import need

    need(r, "chi2_good", "chi2_bad", "chi2_crit", "worst_z", "gammas", "gaps", "n_configs", "ngram_speedup",
         "verify_cost_ratio", "acceptance", "speedup", "tokens_per_verify", "verify_parts", "verify_steps",
         "near_tie", "smoke")
    crit, gaps, tie = r["chi2_crit"], r["gaps"], r["near_tie"]
    worst_gap = max((g for v in gaps.values() for g in v), default=0.0)
    best_k = max(r["ngram_speedup"], key=r["ngram_speedup"].get)
    best = r["ngram_speedup"][best_k]
    out = [
        (f"speculative sampling keeps p: chi-square {r['chi2_good']:.1f} < {crit}", r["chi2_good"] < crit),
        (f"the negative control (resampling from p instead of the residual) is caught: chi-square "
         f"{r['chi2_bad']:.1f} > {crit}", r["chi2_bad"] > crit),
        (f"check of the verifier (i.i.d. guesses, where the formula's assumption holds): (1 - a^(g+1)) / (1 - a) "
         f"matches the simulation within 4 standard errors (worst {r['worst_z']:.1f}) for g in {list(r['gammas'])}",
         r["worst_z"] < 4),
        (f"greedy output token-identical to plain decoding for {r['n_configs']} speculative configurations, apart "
         f"from near-ties < {tie:.2g} (the rounding of the model's dtype; worst gap at a difference: {worst_gap:.2g})",
         worst_gap < tie),
        (f"the engines' verify step ran your parts ({', '.join(sorted(r['verify_parts'])) or 'none'}) in "
         f"{r['verify_steps']} verify steps", bool(r["verify_parts"]) and all(r["verify_parts"].values())
         and r["verify_steps"] > 0),
        (f"n-gram lookup pays at batch 1 on copy-heavy prompts: {best:.2f}x wall-time speed-up (k={best_k}); a "
         f"5-token pass costs {r['verify_cost_ratio']:.1f}x a 1-token pass here", best > 1.0),
    ]
    out.append(speedup_ceiling_claim(r["speedup"], r["tokens_per_verify"], r["smoke"]))
    acc = r["acceptance"]
    if "self-draft k=3" in acc and "draft k=4" in acc:  # section 4's reason for the self-draft
        a_self, a_dist = acc["self-draft k=3"] or 0.0, acc["draft k=4"] or 0.0
        out.append((f"the quantized self-draft's guesses are kept more often than the distilled draft's: "
                    f"{a_self:.0%} vs {a_dist:.0%}", a_self > a_dist))
    return out


def proposer_verdicts(rows: dict[str, dict], smoke: bool, noise: float = 0.15) -> list[str]:
    """One line per speculative configuration of a `compare` result: what its guesses bought in this run and, when
    it did not pay, which side lost (too few guesses kept, or good guesses that cost more than they saved). In
    SMOKE the speed-ups are noise: the line says so and gives only the counts."""
    from lab_utils.speculative.payoff import SMOKE_SKIP

    out = []
    for name, s in rows.items():
        acc, tpv, sp = s.get("acceptance_rate"), s.get("mean_tokens_per_verify_step"), s.get("median_speedup")
        if acc is None or tpv is None:
            continue
        k = len(s.get("acceptance_per_position") or []) or None
        kept = f"{name}: kept {acc:.0%} of its guesses, {tpv:.2f} tokens per verify step"
        if smoke:
            out.append(f"{kept}; whether it pays: {SMOKE_SKIP}")
        elif sp is None:
            out.append(kept)
        elif sp > 1 + noise / 3:
            out.append(f"{kept}: pays ({sp:.2f}x)")
        elif k is not None and tpv >= 1 + k / 2:
            out.append(f"{kept}: does not pay ({sp:.2f}x) although most guesses are kept: the step (its (k+1)-row "
                       f"verify pass and the guessing) costs more than those {tpv:.2f} plain steps")
        else:
            out.append(f"{kept}: does not pay ({sp:.2f}x): too few guesses kept to pay for the verify step")
    return out


def speedup_ceiling_claim(speedup: dict, tokens_per_verify: dict, smoke: bool, noise: float = 0.15):
    """No configuration's speed-up may exceed its tokens per verify step: a verify step costs at least one plain
    step (its pass has k+1 rows, its guesses cost extra) and yields that many tokens. A figure above it (beyond
    `noise`) is a timing artefact, not a result. In SMOKE (one short prompt, one round) the check is skipped."""
    from lab_utils.speculative.payoff import SMOKE_SKIP

    text = "every speed-up is at most its tokens per verify step (a verify step costs at least a plain step)"
    if smoke:
        return (f"{text}: {SMOKE_SKIP}", None)
    over = {n: (s, tokens_per_verify[n]) for n, s in speedup.items()
            if s is not None and tokens_per_verify.get(n) is not None and s > tokens_per_verify[n] * (1 + noise)}
    detail = "; ".join(f"{n}: {s:.2f}x at {e:.2f} tokens per step" for n, (s, e) in over.items())
    return (text + (f": NOT for {detail}" if over else ""), not over)


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 07's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
