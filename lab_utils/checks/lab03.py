"""Checks for lab 03's exercise: filling one step's token budget (vLLM V1's unified scheduler, simplified).

`fn(decodes, prefills, budget) -> [(request_id, num_tokens), ...]`: every running decode gets 1 token first (in
order, while the budget lasts), then waiting prompts, first come first served, each getting as many of its
remaining prompt tokens as the budget still allows (the last one is chunked). The check compares with a
reference on fresh random cases and names the mistake; it never shows the reference.
"""
from __future__ import annotations

import random
from typing import Callable


def _reference(decodes: list[str], prefills: list[tuple[str, int]], budget: int) -> list[tuple[str, int]]:
    out = []
    for rid in decodes:
        if budget == 0:
            return out
        out.append((rid, 1))
        budget -= 1
    for rid, remaining in prefills:
        if budget == 0:
            break
        n = min(remaining, budget)
        out.append((rid, n))
        budget -= n
    return out


def _case(rng: random.Random) -> tuple[list[str], list[tuple[str, int]], int]:
    decodes = [f"d{i}" for i in range(rng.randint(0, 6))]
    prefills = [(f"p{i}", rng.randint(1, 300)) for i in range(rng.randint(0, 4))]
    budget = rng.choice([1, 4, 16, 32, 64, 128, 512])
    return decodes, prefills, budget


def check_fill_budget(fn: Callable, seed: int | None = None, cases: int = 60) -> None:
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    fixed = [(["d0"], [("p0", 10), ("p1", 100), ("p2", 5)], 50),
             (["d0", "d1", "d2"], [("p0", 2000)], 512),  # the quiz's case: 509 prompt tokens this step
             (["d0", "d1", "d2", "d3"], [("p0", 7)], 3)]
    for i, (decodes, prefills, budget) in enumerate(fixed + [_case(rng) for _ in range(cases)]):
        want = _reference(decodes, prefills, budget)
        got = fn(list(decodes), list(prefills), budget)
        where = f"(case {i}: decodes={decodes}, prefills={prefills}, budget={budget})"
        if got is None:
            raise AssertionError(f"returned None; return a list of (request_id, num_tokens) {where}")
        got = [(r, int(n)) for r, n in got]
        if got == want:
            continue
        total = sum(n for _, n in got)
        if total > budget:
            raise AssertionError(f"scheduled {total} tokens, more than the budget of {budget} {where}")
        if any(n <= 0 for _, n in got):
            raise AssertionError(f"an entry with {min(n for _, n in got)} tokens: schedule only n >= 1 {where}")
        got_dec = [r for r, _ in got if r.startswith("d")]
        want_dec = [r for r, _ in want if r.startswith("d")]
        if got_dec != want_dec or (got and want_dec and got[0][0] != want[0][0]):
            raise AssertionError(f"decodes got {got_dec} but expected {want_dec} scheduled first, one token each: "
                                 f"running requests must never wait behind a prompt {where}")
        if any(r.startswith("d") and n != 1 for r, n in got):
            raise AssertionError(f"a decode computes exactly 1 token per step {where}")
        got_p, want_p = [x for x in got if x[0].startswith("p")], [x for x in want if x[0].startswith("p")]
        if [r for r, _ in got_p] != [r for r, _ in want_p][:len(got_p)]:
            raise AssertionError(f"prompts scheduled {got_p} but expected {want_p}: first come first served, and "
                                 f"do not skip ahead to a later prompt that fits {where}")
        if total < sum(n for _, n in want):
            raise AssertionError(f"scheduled only {total} of the {budget}-token budget (expected {want}): a prompt "
                                 f"that does not fit whole is chunked to fill the rest {where}")
        raise AssertionError(f"got {got}, expected {want} {where}")
    print(f"check_fill_budget passed ({len(fixed) + cases} cases)")
