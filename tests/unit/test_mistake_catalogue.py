"""Every mistake of the catalogue fails the check of the lab that teaches its part, with a message that names the
part, its file in the learner's engine folder and that lab, says what the learner must be told, and carries a
"likely mistake" line only from the diagnoser whose evidence is in the failure."""
from __future__ import annotations

import pytest
from mistake_catalogue import CATALOGUE, Mistake

from lab_utils.course import learner_parts
from lab_utils.checks import lab01, lab02, lab03, lab04, parts_check
from lab_utils.checks.part_mistakes import DIAGNOSERS, MISTAKES
from lab_utils.course.parts import PARTS


def ref(name: str):
    return PARTS[name].reference()


def run_check(m: Mistake) -> None:
    """The lab's check cell, with the mistake in place of the learner's part (the other part of a two-part
    check is the reference)."""
    f = m.wrong
    calls = {
        "lab01.check_schedule_continuous": lambda: lab01.check_schedule_continuous(f),
        "lab01.check_stop_reason": lambda: lab01.check_stop_reason(f),
        "lab02.check_allocator": lambda: lab02.check_allocator(
            f if m.part.endswith("grow") else ref("block_manager.grow"),
            f if m.part.endswith("release") else ref("block_manager.release")),
        "lab02.check_preemption": lambda: lab02.check_preemption(
            f if m.part.endswith("make_room") else ref("scheduler.make_room"),
            f if m.part.endswith("preempt") else ref("scheduler.preempt")),
        "lab03.check_schedule_token_budget": lambda: lab03.check_schedule_token_budget(f),
        "lab04.check_hash_block": lambda: lab04.check_hash_block(f),
        "lab04.check_match_prefix": lambda: lab04.check_match_prefix(f),
        "lab04.check_commit_full_blocks": lambda: lab04.check_commit_full_blocks(f),
        "lab04.check_recycle": lambda: lab04.check_recycle(f),
        "lab04.check_evict": lambda: lab04.check_evict(f),
    }
    calls[m.check]()


def test_the_catalogue_covers_every_part_of_labs_01_to_04():
    taught = {n for n, p in PARTS.items() if p.lab <= "04" and p.component != "attention"}
    assert taught <= {m.part for m in CATALOGUE}
    assert len({m.id for m in CATALOGUE}) == len(CATALOGUE)


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> dict[str, AssertionError | None]:
    """Every catalogue entry run once through its check: {entry id: the failure, or None if it passed}."""
    folder = tmp_path_factory.mktemp("learner") / "my_engine"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_LEARNER_DIR", str(folder))
        out = {}
        for m in CATALOGUE:
            learner_parts.forget()
            try:
                run_check(m)
                out[m.id] = None
            except AssertionError as err:
                out[m.id] = err
        learner_parts.forget()
    return out


@pytest.mark.parametrize("m", CATALOGUE, ids=[m.id for m in CATALOGUE])
def test_each_mistake_fails_its_labs_check_naming_part_file_and_lab(m: Mistake, failures):
    err = failures[m.id]
    assert err is not None, f"{m.id} passed {m.check} (lab {m.lab})"
    msg = str(err)
    part = PARTS[m.part]
    assert m.part in msg and f"lab {m.lab}" in msg and f"my_engine/{part.component}.py" in msg, msg
    assert m.told in msg, msg
    got = getattr(err, "diagnosis", None)
    assert got == m.diagnosis, f"diagnosis {got!r}, expected {m.diagnosis!r}:\n{msg}"
    if m.diagnosis is None:  # no diagnoser had evidence: no likely-mistake line of theirs
        assert not any(d.text in msg for d in DIAGNOSERS), msg
    assert "the state before the call" not in msg and len(msg) < 2500, "a state difference, not a state dump"


@pytest.mark.parametrize("d", DIAGNOSERS, ids=[d.id for d in DIAGNOSERS])
def test_each_diagnoser_speaks_for_its_own_mistake_only(d, failures):
    """A diagnoser's line appears in the failures of the catalogue entries it diagnoses and in no other."""
    assert any(m.diagnosis == d.id for m in CATALOGUE), f"no catalogue mistake shows diagnoser {d.id}"
    spoke = [m.id for m in CATALOGUE if m.diagnosis != d.id and failures[m.id] is not None
             and d.text in str(failures[m.id])]
    assert not spoke, f"{d.id} spoke for {spoke}"


def test_every_diagnoser_speaks_for_a_part_the_checker_knows():
    assert set(MISTAKES) <= set(parts_check.PART_CHECKS)
    assert all(parts_check.PART_CHECKS[name].diagnosers == ds for name, ds in MISTAKES.items())


def test_a_failing_part_is_not_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    m = next(m for m in CATALOGUE if m.check == "lab02.check_preemption")
    with pytest.raises(AssertionError):
        run_check(m)
    assert not (tmp_path / "my_engine" / "scheduler.py").exists()


def test_the_reference_parts_pass_every_check(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    for check in sorted({m.check for m in CATALOGUE}):
        part = next(m.part for m in CATALOGUE if m.check == check)
        run_check(Mistake(part, PARTS[part].lab, check, ref(part), "", None))
    learner_parts.forget()


def test_a_wrong_part_that_stops_a_later_labs_engine_is_named_with_its_lab_and_file(tmp_path, monkeypatch):
    """The tester's case: lab 03's step ignoring start()'s return stops lab 04's engine (prefix caching on); the
    message names that step, lab 03 and my_engine/scheduler.py, and its first wrong value, not the block manager."""
    from lab_utils.course.parts import EngineParts
    from mistake_catalogue import budget_ignores_start

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    parts = EngineParts({"scheduler.schedule_token_budget": budget_ignores_start,
                         "block_manager.grow": ref("block_manager.grow")})
    with pytest.raises(AssertionError) as err:
        parts_check.check_in_engine(parts, "04", num_requests=12)
    msg = str(err.value)
    assert "the cause: scheduler.schedule_token_budget (lab 03, my_engine/scheduler.py)" in msg, msg
    assert "n = self.start(req, n)" in msg and "block_manager.grow (lab" not in msg.split("the cause:")[1], msg
