"""Checks for lab 04's exercises: the prefix cache inside the engine's `BlockManager`.

Four parts (see `lab_utils.course.parts`): `hash_block` names a full block, `match_prefix` finds a new prompt's
cached leading blocks, `recycle` decides what happens to a block nobody references any more (kept in the LRU
list if it holds a named prefix, else freed), `evict` takes the least recently used cached block back.

Each `check_*` is `parts_check.check_part`: first the small hand-built block pools of `part_cases` in which one
known mistake shows (named by `parts_check`'s diagnosers when the difference is evidence for it), then the reference
against the function on random engine states in every setting the engine runs it in (prefix caching on and off
included: the engine's "caching off" baselines run these parts too); when both pass it becomes the engine's part
(`learner_parts.submit`). The reference is never shown.
"""
from __future__ import annotations

from typing import Callable

from lab_utils.checks import parts_check
from lab_utils.checks.claims import Claim


def _check(name: str, fn: Callable, trials: int, seed: int, submit: bool) -> None:
    """The generic grader runs the part's hand-built pools first (`part_cases`: states in which one known mistake
    shows), then random pools in every setting; on success (and with `submit`) the function becomes the engine's
    part, saved to my_engine/block_manager.py."""
    from lab_utils.course import learner_parts

    parts_check.check_part(name, fn, trials=trials, seed=seed)
    if submit:
        learner_parts.submit(name, fn)


def check_hash_block(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, parent_hash, token_ids) -> int`: the name of a full block, chained over the whole prefix."""
    _check("block_manager.hash_block", fn, trials, seed, submit)


def check_match_prefix(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, req) -> [block ids]`: the cached blocks holding the prompt's leading full blocks, in order (a
    whole prefix only; a name that collides with other tokens is no hit; nothing with caching off)."""
    _check("block_manager.match_prefix", fn, trials, seed, submit)


def check_recycle(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, block_id) -> None` for a block whose reference count just reached 0."""
    _check("block_manager.recycle", fn, trials, seed, submit)


def check_evict(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self) -> block_id`: the least recently used cached block, taken out of the cache."""
    _check("block_manager.evict", fn, trials, seed, submit)


def check_commit_full_blocks(fn: Callable, trials: int = 200, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, req) -> None`: names every block of `req` whose tokens are all computed. Hand-built pools (the
    same prompt computed twice at once; caching off), then random pools in every setting; then the engine names
    blocks with it."""
    _check("block_manager.commit_full_blocks", fn, trials, seed, submit)


# --- the lab's closing claims --------------------------------------------------------------------------------
CACHED_RUN_PARTS = tuple(f"block_manager.{p}" for p in ("hash_block", "commit_full_blocks", "match_prefix",
                                                         "recycle", "evict"))


def claims(r: dict) -> list[Claim]:
    """Lab 04's claims from the runs' measurements `r` (built in the notebook's claims cell).

    The TTFT and replay claims expect what this device's prefill costs predict (`ttft_cut_predicted`, from
    `lab_utils.sim.prefill_cost` and the hits of the run): on a CPU a hit saves most of a prompt's prefill; on a GPU a
    small model's prefill is launch-bound, so a hit saves little time there, and the claim says so. `calls`: how
    often the cached runs called each of your parts (`parts.calls` over those runs)."""
    from lab_utils.checks.claims import need, parts_called

    need(r, "hit_rate", "mean_ttft_off_ms", "mean_ttft_on_ms", "ttft_cut_predicted", "replay_s_off", "replay_s_on",
         "hit_rate_by_pool", "replies_identical", "replies", "calls")
    cut, pred = 1 - r["mean_ttft_on_ms"] / r["mean_ttft_off_ms"], r["ttft_cut_predicted"]
    compute_bound = pred >= 0.5  # a hit saves most of the prefill: it must show plainly
    pools = r["hit_rate_by_pool"]
    small, large = pools[min(pools)], pools[max(pools)]
    ratio = r["replay_s_off"] / r["replay_s_on"]
    return [
        (f"hit rate {r['hit_rate']:.2f} >= 0.5 on the shared-prefix workload", r["hit_rate"] >= 0.5),
        (f"TTFT reduced by {100 * cut:.0f}%, >= 0.6x of the {100 * pred:.0f}% this device's measured prefill costs "
         f"predict for these hits" + (" (and >= 30%, as prefill is compute-bound here)" if compute_bound else ""),
         cut >= 0.6 * pred - 0.05 and (cut >= 0.30 or not compute_bound)),
        (f"the replay finishes faster with caching ({ratio:.2f}x)" if pred >= 0.1 else
         f"the replay is no slower with caching ({ratio:.2f}x; prefill is launch-bound here, a hit saves little)",
         r["replay_s_on"] < r["replay_s_off"] if pred >= 0.1 else r["replay_s_on"] <= 1.05 * r["replay_s_off"]),
        (f"memory pressure evicts: hit rate {small:.2f} (smallest pool) < {large:.2f} (largest)", small < large),
        (f"the cache changes no reply: {r['replies_identical']} of {r['replies']} greedy replies identical with "
         f"caching off and on (or parting first at a near-tie of the model's dtype)", r["replies"] > 0 and r["replies_identical"] == r["replies"]),
        parts_called("the cached runs (the replay and the pool sweep, whose small pools evict)", r["calls"],
                     CACHED_RUN_PARTS),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 04's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
