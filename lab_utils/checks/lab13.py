"""Checks for lab 13 (structured output): the mask step, and the lab's closing claims.

`check_mask_step` tests a learner's `apply_token_bitmask(logits, bitmask)` on fresh random bitmasks (vocabulary
sizes that do and do not fill the last 32-bit word) and `advance_matcher(matcher, token_ids)` on a real
xgrammar matcher over a tiny vocabulary, and says what differs without showing the reference.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import torch

from lab_utils.checks.claims import Claim
from lab_utils.structured.hook import apply_token_bitmask as _ref_apply


def _check_apply(fn: Callable, rng: random.Random) -> None:
    for vocab in (64, 1000, rng.randint(40, 300)):
        n = rng.randint(1, 4)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, generator=g)
        bitmask[0, 0] = -(1 << 31) | 0b101  # tokens 0, 2 and 31 allowed: bit j of word w is token 32*w + j
        logits = torch.randn(n, vocab, generator=g)
        want = _ref_apply(logits.clone(), bitmask.clone())
        got = fn(logits.clone(), bitmask.clone())
        if got is None:
            raise AssertionError("apply_token_bitmask returned None: return the masked logits (a tensor [n, V])")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"apply_token_bitmask must return a tensor of shape {tuple(want.shape)} (the "
                                 f"logits' shape), got {getattr(got, 'shape', type(got).__name__)}")
        if got.dtype != want.dtype:
            raise AssertionError(f"the masked logits should keep the logits' dtype {want.dtype}, got {got.dtype}")
        want_allowed, got_allowed = torch.isfinite(want), torch.isfinite(got)
        if not torch.equal(want_allowed, got_allowed):
            r, t = (want_allowed != got_allowed).nonzero()[0].tolist()
            w, j = divmod(t, 32)
            verdict = "allowed" if want_allowed[r, t] else "forbidden"
            if torch.equal(got_allowed, ~want_allowed):
                hint = " (your mask is inverted: a set bit (1) means the token is allowed)"
            elif t == 31 or t == 0 or t == 2:
                hint = " (bit j counts from the least significant bit: token 32*w + j is (word >> j) & 1)"
            elif t >= vocab - vocab % 32 and vocab % 32:
                hint = (f" (the last word covers tokens {vocab - vocab % 32}..{vocab - 1} only: token 32*w + j is "
                        f"(word >> j) & 1 there too)")
            else:
                hint = (f" (token {t} is allowed exactly when bit {j} of word {w} of its row is set: "
                        f"(bitmask[{r}, {w}] >> {j}) & 1, the word read as 32 bits, sign bit included)")
            raise AssertionError(f"row {r}, token {t} (word {w}, bit {j}, vocab {vocab}): the bitmask says "
                                 f"{verdict} but your logit there is {float(got[r, t])}{hint}")
        if not torch.equal(got[got_allowed], want[want_allowed]):
            raise AssertionError("an allowed token's logit changed: leave allowed logits exactly as they were")
        if not torch.all(got[~got_allowed] == float("-inf")):
            raise AssertionError("forbidden tokens must get -inf (so softmax gives them probability 0)")


def _tiny_matcher():
    """A matcher for the regex ab+c over the vocabulary a, b, c, bc, </s>."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo(["a", "b", "c", "bc", "</s>"], stop_token_ids=[4])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex("ab+c")), info


def _allowed(matcher, info) -> set[int]:
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bm)
    return {t for t in range(info.vocab_size) if (int(bm[0, t // 32]) >> (t % 32)) & 1}


def _check_advance(fn: Callable) -> None:
    m, info = _tiny_matcher()
    ok = fn(m, [0, 1, 1])  # "a b b"
    if ok is not True:
        raise AssertionError(f"advance_matcher(matcher, [a, b, b]) should return True (the grammar ab+c accepts "
                             f"them), got {ok!r}")
    left = _allowed(m, info)
    if left != {1, 2, 3}:
        raise AssertionError(f"after [a, b, b] the grammar ab+c allows b, c or bc next, but your matcher allows "
                             f"token ids {sorted(left)}: feed every token to matcher.accept_token, in order")
    m2, _ = _tiny_matcher()
    if fn(m2, [0, 2, 2]) is not False:  # "a c c": c is refused right after a
        raise AssertionError("advance_matcher(matcher, [a, c, c]) should return False: the grammar ab+c refuses c "
                             "right after a (matcher.accept_token returns False)")
    m3, _ = _tiny_matcher()
    if fn(m3, []) is not True:
        raise AssertionError("advance_matcher(matcher, []) should return True (nothing to accept)")


def check_mask_step(apply_fn: Callable, advance_fn: Callable, seed: int | None = None) -> None:
    """Check the learner's `apply_token_bitmask` and `advance_matcher` against the reference behaviour."""
    rng = random.Random(seed)
    _check_apply(apply_fn, rng)
    _check_advance(advance_fn)
    print("mask step: passed (bitmask -> -inf on forbidden tokens, matcher advanced by every accepted token)")


# ------------------------------------------------------------------------------------------ claims
def claims(r: dict) -> list[Claim]:
    """Lab 13's claims from the run's measurements `r` (built in the notebook's claims cell). With random weights
    (`model`, the lab's MODEL) the valid rates are NOT JUDGED: a random model inside a grammar can spend its whole
    token budget in one string, and ignores the prompt's instructions."""
    from lab_utils.checks.claims import need, trained_only
    from lab_utils.checks.timing import judge

    need(r, "num_tasks", "prompt_valid_rate", "constrained_valid_rate", "yours_same_as_reference",
         "neighbours_identical", "overlap_fill_ms", "overlap_wait_ms", "mask_exposed_ms", "step_ms",
         "mixed_over_free_throughput")
    share = r["mask_exposed_ms"] / r["step_ms"]
    forward_ms = r["step_ms"] - r["mask_exposed_ms"]  # the step outside grammar work: what a fill can hide behind
    short = forward_ms < r["overlap_fill_ms"]
    m = r["mixed_over_free_throughput"]  # per-round ratios of interleaved runs (one float: one round)
    rounds = [float(x) for x in m] if isinstance(m, (list, tuple)) else [float(m)]
    out = [
        trained_only((f"check of the implementation: with the grammar, {r['constrained_valid_rate']:.0%} of "
                      f"{r['num_tasks']} outputs are schema-valid (must be 100%)", r["constrained_valid_rate"] == 1.0),
                     r.get("model")),
        trained_only((f"the prompt alone gives fewer valid outputs ({r['prompt_valid_rate']:.0%}) than the grammar",
                      r["prompt_valid_rate"] < r["constrained_valid_rate"]), r.get("model")),
        ("the engine with your mask step produced exactly the reference engine's tokens",
         bool(r["yours_same_as_reference"])),
        ("unconstrained requests beside constrained ones are token-identical to a run with no constrained "
         "neighbour (or part first at a near-tie of the model's dtype)", bool(r["neighbours_identical"])),
        _hidden_behind_forward(
            (f"with overlap the step waited {r['overlap_wait_ms']:.3f} ms for masks that took "
             f"{r['overlap_fill_ms']:.3f} ms to fill (under half: the fill hid behind the forward)",
             r["overlap_wait_ms"] < 0.5 * r["overlap_fill_ms"]), short, forward_ms, r["overlap_fill_ms"]),
        _hidden_behind_forward(
            (f"grammar work on the critical path is {share:.1%} of a constrained step ({r['mask_exposed_ms']:.2f} of "
             f"{r['step_ms']:.1f} ms; under 20%)", share < 0.2), short, forward_ms, r["overlap_fill_ms"]),
        judge("a batch with half its requests constrained keeps >= 50% of the all-free output throughput "
              "(the two batches interleaved, one ratio a round)", rounds, 0.5,
              "rerun the mixed-batch cell with MIXED_ROUNDS raised when the machine is quieter"),
    ]
    if r.get("vllm_constrained_valid_rate") is not None:
        out.append((f"vLLM's structured output on the same prompts: {r['vllm_constrained_valid_rate']:.0%} "
                    f"schema-valid (must be 100%)", r["vllm_constrained_valid_rate"] == 1.0))
    return out


def _hidden_behind_forward(claim: Claim, short: bool, forward_ms: float, fill_ms: float) -> Claim:
    """A claim that the mask fill hides behind the forward, judged where this device's forward is at least as long
    as the fill; where it is shorter (a fast device's step) there is nothing to hide behind: NOT JUDGED, saying so."""
    if not short:
        return claim
    return (f"{claim[0]} -- NOT JUDGED: on this device the forward ({forward_ms:.2f} ms: the step less its grammar "
            f"work) is shorter than the mask fill ({fill_ms:.2f} ms), so no overlap can hide the fill here", None)


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 13's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
