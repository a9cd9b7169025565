"""Lab 07's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import pytest
import torch

from lab_utils.course import learner_parts
from lab_utils.checks import lab07
from lab_utils.course.parts import EngineParts
from lab_utils.speculative.chi_square import CHI2_CRIT_DF5
from lab_utils.speculative.hook import rollback


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    """Checks that pass submit the part: keep the saved files out of the repository."""
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    learner_parts.forget()
    yield
    learner_parts.forget()


def good_residual(p, q):
    r = torch.clamp(p - q, min=0)
    return p if r.sum() == 0 else r / r.sum()


def good_accept_reject(p, q, draft, u):
    for i, x in enumerate(draft):
        if u[i] >= min(1.0, float(p[i, x] / q[i, x])):
            return i, good_residual(p[i], q[i])
    return len(draft), p[len(draft)]


def test_residual_accepts_a_correct_solution():
    lab07.check_residual(good_residual, seed=0)


@pytest.mark.parametrize("bad, message", [
    (lambda p, q: p, "returned p"),
    (lambda p, q: (p - q) / (p - q).sum(), "negative"),
    (lambda p, q: torch.clamp(p - q, min=0), "normalised"),
    (lambda p, q: torch.clamp(p - q, min=0) / torch.clamp(p - q, min=0).sum(), "fall back to p"),
])
def test_residual_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_residual(bad, seed=0)


def test_accept_reject_accepts_a_correct_solution():
    lab07.check_accept_reject(good_accept_reject, seed=0)
    lab07.check_accept_reject(lambda p, q, d, u: lab07.reference_accept_reject(p, q, d, u), seed=1)


def _inverted(p, q, draft, u):
    for i, x in enumerate(draft):
        if u[i] < min(1.0, float(p[i, x] / q[i, x])) and u[i] > 0:  # accepts only when u is ABOVE: inverted
            return i, good_residual(p[i], q[i])
    return len(draft), p[len(draft)]


def _resample_from_p(p, q, draft, u):
    n, _ = good_accept_reject(p, q, draft, u)
    return n, p[n]


def _bonus_from_last_draft_row(p, q, draft, u):
    n, d = good_accept_reject(p, q, draft, u)
    return (n, p[n - 1]) if n == len(draft) else (n, d)


def _never_stops(p, q, draft, u):
    kept = sum(1 for i, x in enumerate(draft) if u[i] < min(1.0, float(p[i, x] / q[i, x])))
    return kept, good_residual(p[min(kept, len(draft) - 1)], q[min(kept, len(draft) - 1)]) if kept < len(draft) else p[kept]


@pytest.mark.parametrize("bad, message", [
    (_inverted, "n_accepted"),
    (_resample_from_p, "residual"),
    (_bonus_from_last_draft_row, "bonus"),
    (_never_stops, "n_accepted|dist"),
    (lambda p, q, d, u: (len(d), p[len(d)]), "n_accepted"),
    (lambda p, q, d, u: [0, p[0]], "tuple"),
])
def test_accept_reject_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_accept_reject(bad, seed=0)


def test_checkers_let_not_implemented_propagate():
    def todo(*a):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab07.check_residual(todo, seed=0)
    with pytest.raises(NotImplementedError):
        lab07.check_accept_reject(todo, seed=0)


# --- the rollback ------------------------------------------------------------------------------------------------
def good_rollback(req, bm, num_guesses, num_accepted):  # an independent solution
    req.token_ids = req.token_ids[:len(req.token_ids) - num_guesses]
    req.num_computed_tokens = req.num_computed_tokens - num_guesses + num_accepted
    while len(req.block_table) > bm.blocks_needed(req.num_computed_tokens + 1):
        bm.release(req.block_table.pop())


def rollback_variant(*, count=True, free=True, plus_one=True, drop_tokens=True, use_release=True):
    def fn(req, bm, num_guesses, num_accepted):
        if drop_tokens:
            del req.token_ids[len(req.token_ids) - num_guesses:]
        if count:
            req.num_computed_tokens -= num_guesses - num_accepted
        if free:
            keep = bm.blocks_needed(req.num_computed_tokens + (1 if plus_one else 0))
            for bid in reversed(req.block_table[keep:]):
                if use_release:
                    bm.release(bid)
            del req.block_table[keep:]
    return fn


def test_rollback_accepts_a_correct_solution(capsys):
    lab07.check_rollback(rollback)
    lab07.check_rollback(good_rollback, seed=1)
    assert "check_rollback passed" in capsys.readouterr().out
    assert learner_parts.load_part("spec.rollback") is good_rollback


@pytest.mark.parametrize("kw, message", [
    (dict(count=False), "num_guesses - num_accepted"),
    (dict(free=False), "num_computed_tokens \\+ 1 tokens"),
    (dict(plus_one=False), "one block too many"),
    (dict(drop_tokens=False), "off the end of req.token_ids"),
    (dict(use_release=False), "block_manager.release"),
])
def test_rollback_names_each_mistake(kw, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab07.check_rollback(rollback_variant(**kw))
    assert str(err.value).startswith("spec.rollback (lab 07, my_engine/spec.py): ")
    assert "num_guesses = 0" not in str(err.value)  # the zero-guess cause stays silent on other mistakes


def _cuts_from_the_end(req, bm, num_guesses, num_accepted):
    req.token_ids = req.token_ids[:-num_guesses]  # [:-0] is [:0]: empties the list when nothing was guessed
    good_rollback_rest(req, bm, num_guesses, num_accepted)


def _deletes_from_the_end(req, bm, num_guesses, num_accepted):
    del req.token_ids[-num_guesses:]  # [-0:] is the whole list
    good_rollback_rest(req, bm, num_guesses, num_accepted)


def good_rollback_rest(req, bm, num_guesses, num_accepted):
    req.num_computed_tokens -= num_guesses - num_accepted
    while len(req.block_table) > bm.blocks_needed(req.num_computed_tokens + 1):
        bm.release(req.block_table.pop())


@pytest.mark.parametrize("bad", [_cuts_from_the_end, _deletes_from_the_end])
def test_rollback_with_zero_guesses_names_the_slice_from_the_end(bad):
    with pytest.raises(AssertionError, match="0 guesses, 0 accepted") as err:
        lab07.check_rollback(bad)
    assert "with num_guesses = 0 (nothing was guessed) nothing changes" in str(err.value)
    assert str(err.value).startswith("spec.rollback (lab 07, my_engine/spec.py): ")


# --- the verify step in the engine ---------------------------------------------------------------------------
def good_greedy(logits, draft):  # an independent solution
    best = logits.argmax(-1)
    for i, x in enumerate(draft):
        if int(best[i]) != x:
            return draft[:i] + [int(best[i])]
    return draft + [int(best[-1])]


def _no_bonus(logits, draft):
    out = good_greedy(logits, draft)
    return out[:-1] if out[:-1] == draft else out


def _appends_the_guess(logits, draft):
    out = good_greedy(logits, draft)
    n = len(out) - 1
    return out if n == len(draft) else out[:-1] + [draft[n]]


def _never_stops(logits, draft):
    best = logits.argmax(-1).tolist()
    kept = [x for i, x in enumerate(draft) if x == best[i]]
    return kept + [best[len(kept)]]


def _row_off_by_one(logits, draft):
    return good_greedy(logits[1:], draft[:-1]) + ([draft[-1]] if len(draft) > 0 else [])


def test_verify_greedy_accepts_a_correct_solution(capsys):
    lab07.check_verify_greedy(good_greedy, seed=0)
    lab07.check_verify_greedy(good_greedy)
    assert "check_verify_greedy passed" in capsys.readouterr().out


@pytest.mark.parametrize("bad, message", [
    (_no_bonus, "bonus"),
    (_appends_the_guess, "correction"),
    (_never_stops, "stop at the first|returned"),
    (_row_off_by_one, "expected"),
    (lambda logits, draft: None, "list of token ids"),
])
def test_verify_greedy_names_each_mistake(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_verify_greedy(bad, seed=2)


MINE = {"spec.residual": good_residual, "spec.accept_reject": good_accept_reject, "spec.verify_greedy": good_greedy,
        "spec.rollback": good_rollback}


def test_verify_in_engine_accepts_correct_parts():
    summary = lab07.check_verify_in_engine(EngineParts(MINE), num_requests=4)
    assert summary["chi2_first"] < CHI2_CRIT_DF5
    assert all(0 < summary["accepted"][m] < summary["proposed"][m] for m in ("greedy", "sampling"))


@pytest.mark.parametrize("name, wrong, message", [
    ("spec.accept_reject", _resample_from_p, "does not keep the target's distribution"),  # resample from p
    ("spec.verify_greedy", _no_bonus, "kept"),                                          # the bonus forgotten: slower
    ("spec.rollback", rollback_variant(count=False), "stopped|other tokens"),            # rejected KV still counted
    ("spec.rollback", rollback_variant(free=False), "free KV blocks"),                   # blocks held to the end
])
def test_verify_in_engine_catches_a_wrong_part(name, wrong, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_verify_in_engine(EngineParts({**MINE, name: wrong}), num_requests=4)


def test_a_wrong_walk_alone_is_caught_in_greedy_too():
    """Without a greedy verify of the learner's, the engine runs greedy as the walk on one-hot distributions."""
    with pytest.raises(AssertionError, match="other tokens"):
        lab07.check_verify_in_engine(EngineParts({"spec.accept_reject": _bonus_from_last_draft_row}), num_requests=4)


def test_a_wrong_residual_alone_is_caught_through_the_engines_own_walk():
    with pytest.raises(AssertionError, match="does not keep the target's distribution"):
        lab07.check_verify_in_engine(EngineParts({"spec.residual": lambda p, q: p}), num_requests=2)


# --- section 5's payoff arithmetic: figures of one run that contradict each other are refused ---------------
from lab_utils.speculative import payoff  # noqa: E402

EAGLE = dict(tokens_per_verify=1.8, step_cost=0.2, measured=0.95)  # v 1.36, k 3: predicted 0.92x


def test_payoff_passes_consistent_figures():
    lines = payoff.check_payoff({"eagle k=3": EAGLE}, verify_cost=1.36, k=3)
    assert lines == ["eagle k=3: predicted 0.92x, measured 0.95x (within 1.5x): breaks even"]


@pytest.mark.parametrize("row, v, message", [
    (EAGLE, 0.52, "v = 0.52x one row"),                                     # a verify pass cheaper than one row
    (EAGLE | dict(tokens_per_verify=1.64, measured=5.3), 1.36, "above the 1.21x"),  # more than E / v can give
    (EAGLE | dict(measured=1.6), 1.36, "more than 1.5x apart"),             # within the ceiling, far from predicted
    (EAGLE | dict(measured=0.5), 1.36, "more than 1.5x apart"),             # too slow for the measured costs
])
def test_payoff_refuses_contradicting_figures(row, v, message):
    with pytest.raises(AssertionError, match=message):
        payoff.check_payoff({"eagle k=3": row}, verify_cost=v, k=3)


def test_a_breakeven_of_zero_is_refused():
    """cost <= 1 plain step gives break-even 0, which no proposer with a cost can have."""
    assert payoff.breakeven_acceptance(3, 0.0, 0.95) == 0.0
    assert any("break-even acceptance 0" in p for p in payoff.consistency_problems("medusa", 1.0, breakeven=0.0))
    assert not payoff.consistency_problems("medusa", 1.0, breakeven=payoff.breakeven_acceptance(3, 0.02, 1.0))


def test_in_smoke_the_measured_speedups_are_not_judged():
    """One 24-token prompt cannot measure a speed-up: SMOKE says so instead of passing noise as a result, but
    still refuses a verify cost below one row's (a median of alternated passes, measurable in any run)."""
    lines = payoff.check_payoff({"eagle k=3": EAGLE | dict(measured=5.3)}, verify_cost=1.36, k=3, smoke=True)
    assert "skipped in SMOKE: too small to measure" in lines[0] and "measured 5.30" not in lines[0]
    with pytest.raises(AssertionError, match="v = 0.52x"):
        payoff.check_payoff({"eagle k=3": EAGLE}, verify_cost=0.52, k=3, smoke=True)


# --- every rejection names the part, its file and a cause --------------------------------------------------------
@pytest.mark.parametrize("bad, msg", [
    (lambda p, q: torch.clamp(q - p, min=0) / torch.clamp(q - p, min=0).sum(), r"max\(0, q - p\)"),
    (lambda p, q: (torch.clamp(p - q, min=0) + 0.01 * p) / (torch.clamp(p - q, min=0) + 0.01 * p).sum(),
     "only where p > q"),
    (lambda p, q: p, "returned p"),
])
def test_residual_rejections_name_part_file_and_cause(bad, msg):
    with pytest.raises(AssertionError, match=msg) as err:
        lab07.check_residual(bad, seed=0)
    assert str(err.value).startswith("spec.residual (lab 07, my_engine/spec.py): ") and "hint: " in str(err.value)


@pytest.mark.parametrize("bad", [_resample_from_p, _bonus_from_last_draft_row])
def test_accept_reject_rejections_name_part_and_file(bad):
    with pytest.raises(AssertionError) as err:
        lab07.check_accept_reject(bad, seed=0)
    assert str(err.value).startswith("spec.accept_reject (lab 07, my_engine/spec.py): ") and "hint: " in str(err.value)


@pytest.mark.parametrize("bad", [_no_bonus, _appends_the_guess])
def test_verify_greedy_rejections_name_part_and_file(bad):
    with pytest.raises(AssertionError) as err:
        lab07.check_verify_greedy(bad, seed=0)
    assert str(err.value).startswith("spec.verify_greedy (lab 07, my_engine/spec.py): ") and "hint: " in str(err.value)
