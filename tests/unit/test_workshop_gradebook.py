"""The gradebook: learner x check from the learners' own records, the time stuck, and the CSV the command writes."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.workshop import gradebook

T0 = 1_700_000_000.0  # a fixed past clock: stuck times are exact


def _log(home: Path, recs: list[tuple], where: str = "student") -> None:
    path = home / where / ".lab_checks.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for dt, lab, check, passed, mistake in recs:
            f.write(json.dumps({"lab": lab, "check": check, "passed": passed, "mistake": mistake, "t": T0 + dt,
                                "cause": "the halves are swapped" if mistake else None}) + "\n")


@pytest.fixture
def homes(tmp_path):
    root = tmp_path / "homes"
    _log(root / "ada", [(0, "00", "check_rope", False, "values differ"), (60, "00", "check_rope", True, None),
                        (120, "00", "check_cached_attention", True, None),
                        (300, "01", "check_schedule_continuous", False, "wrong batch"),
                        (600, "01", "check_schedule_continuous", False, "still wrong")])
    _log(root / "bob", [(30, "00", "check_rope", True, None), (90, "00", "check_rope", False, "oops"),
                        (200, "00", "check_rope", True, None)])
    _log(root / "bob", [(10, "00", "check_rope", False, "first try")], where="student/labs")  # a second log, merged
    (root / "cy").mkdir()  # logged in, no check run yet
    _log(root / ".hidden", [(0, "00", "check_rope", True, None)])  # not a learner
    _log(root / "ada" / ".cache", [(0, "99", "check_x", True, None)], where="")  # hidden folders are not read
    return root


def test_learner_by_check_with_first_pass_attempts_and_time_stuck(homes):
    room = {me.name: me for me in gradebook.room(homes, now=T0 + 900)}
    assert sorted(room) == ["ada", "bob", "cy"]
    ada, bob, cy = room["ada"], room["bob"], room["cy"]
    rope = ada.cells[("00", "check_rope")]
    assert (rope.attempts, rope.passed, rope.first_pass_t, rope.attempts_to_pass) == (2, True, T0 + 60, 2)
    sched = ada.cells[("01", "check_schedule_continuous")]
    assert (sched.passed, sched.last_result, sched.likely_cause) == (False, "still wrong", "the halves are swapped")
    assert ada.current == ("01", "check_schedule_continuous") and ada.stuck_s == 600  # since the first try at 300 s
    assert sched.stuck_s == 600 and rope.stuck_s is None
    brope = bob.cells[("00", "check_rope")]
    assert (brope.attempts, brope.first_pass_t, brope.attempts_to_pass, brope.last_result) == (4, T0 + 30, 2, "passed")
    assert bob.stuck_s == 0 and cy.cells == {} and cy.current is None
    assert gradebook.checks_of(list(room.values())) == [("00", "check_rope"), ("00", "check_cached_attention"),
                                                        ("01", "check_schedule_continuous")]


def test_stuck_counts_from_the_first_failure_since_the_last_pass():
    recs = [{"lab": "02", "check": "check_allocator", "passed": p, "t": T0 + dt}
            for dt, p in [(0, False), (100, True), (200, False), (260, False)]]
    me = gradebook.learner_from_records("x", list(reversed(recs)), now=T0 + 500)  # order of lines does not matter
    assert me.stuck_s == 300 and me.cells[("02", "check_allocator")].attempts_to_pass == 2


def test_grade_command_writes_the_csv(homes, tmp_path):
    out = tmp_path / "grades.csv"
    run = subprocess.run([sys.executable, "-m", "lab_utils", "grade", str(homes), "--csv", str(out)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "ada" in run.stdout and "failing for" in run.stdout and "no checks run yet" in run.stdout
    table = list(csv.DictReader(out.open()))
    assert list(table[0]) == gradebook.COLUMNS
    got = {(r["learner"], r["check"]): r for r in table}
    assert len(table) == 4
    assert got[("ada", "check_rope")]["attempts_to_pass"] == "2"
    assert got[("ada", "check_schedule_continuous")]["last_result"] == "still wrong"
    assert float(got[("ada", "check_schedule_continuous")]["stuck_min"]) >= 10
    assert got[("bob", "check_rope")]["first_pass_time"] == "2023-11-14T22:13:50Z"


def test_not_a_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a folder of learner homes"):
        gradebook.room(tmp_path / "nope")


def test_the_board_escapes_what_a_learner_can_write(tmp_path):
    from lab_utils.workshop.board import grid_html

    _log(tmp_path / "eve", [(0, "00", "check_rope", False, "<script>alert('x')</script> differ")])
    page = grid_html(gradebook.room(tmp_path, now=T0 + 120))
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert ">eve<" in page and "2 min on rope" in page and "&#10007; 1" in page
