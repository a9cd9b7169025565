"""Check records: each check a learner runs leaves one line (lab, check, passed or the mistake, time) in their log."""
from __future__ import annotations

import importlib
import inspect
import json
import os

import pytest
import torch

from lab_utils.workshop import records


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "home" / "student" / ".lab_checks.jsonl"
    monkeypatch.setenv("LAB_CHECKS_LOG", str(path))
    return path


def _good_rope(x, positions, theta):
    from lab_utils.checks.lab00 import reference_rope

    return reference_rope(x, positions, theta)


def _rope_forgot_positions(x, positions, theta):
    return x.clone()


def test_a_real_check_records_pass_and_the_named_mistake(log):
    from lab_utils.checks import lab00

    lab00.check_rope(_good_rope, seed=0)
    with pytest.raises(AssertionError) as err:
        lab00.check_rope(_rope_forgot_positions, seed=0)
    with pytest.raises(NotImplementedError):
        lab00.check_rope(lambda x, p, t: (_ for _ in ()).throw(NotImplementedError("write rope first")), seed=0)
    recs = records.read(log)
    assert [(r["lab"], r["check"], r["passed"]) for r in recs] == [("00", "check_rope", True), ("00", "check_rope", False),
                                                                    ("00", "check_rope", False)]
    assert recs[0]["mistake"] is None
    assert recs[1]["mistake"] == str(err.value).splitlines()[0] and "differ" in recs[1]["mistake"]
    assert recs[2]["mistake"] == "NotImplementedError: write rope first"
    assert all(r["time"].endswith("Z") and r["t"] > 1.7e9 and r["seconds"] >= 0 for r in recs)
    assert "user" not in recs[0]  # who it is comes from whose home the log is in, never from the line


def test_a_check_inside_a_check_records_once_as_the_outer_one(log):
    ns: dict = {"__name__": "lab_utils.checks.lab42"}

    def check_inner(x):
        assert x, "inner says no"

    def check_outer(x):
        ns["check_inner"](x)  # through the module's (wrapped) name, as a check module calls its neighbour

    for f in (check_inner, check_outer):
        f.__module__ = ns["__name__"]
        ns[f.__name__] = f
    assert sorted(records.record_checks(ns)) == ["check_inner", "check_outer"]
    assert records.record_checks(ns) == []  # wrapping twice is a no-op
    ns["check_outer"](True)
    with pytest.raises(AssertionError):
        ns["check_outer"](False)
    recs = records.read(log)
    assert [(r["lab"], r["check"], r["passed"], r["mistake"]) for r in recs] == [
        ("42", "check_outer", True, None), ("42", "check_outer", False, "inner says no")]


def test_every_check_of_every_lab_is_recorded():
    import pkgutil

    import lab_utils.checks as pkg

    wrapped = 0
    for info in pkgutil.iter_modules(pkg.__path__):
        if not (info.name.startswith("lab") or info.name == "parts_check"):
            continue
        mod = importlib.import_module(f"lab_utils.checks.{info.name}")
        for name, fn in vars(mod).items():
            if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == mod.__name__:
                assert getattr(fn, "__recorded__", False), f"{mod.__name__}.{name} does not record its result"
                assert inspect.signature(fn) == inspect.signature(fn.__wrapped__)
                wrapped += 1
    assert wrapped >= 40


def test_parts_checks_take_the_lab_from_the_part_or_the_argument():
    from lab_utils.checks import parts_check

    assert records._lab_of("lab_utils.checks.parts_check", parts_check.check_part.__wrapped__,
                           ("scheduler.schedule_token_budget", None), {}) == "03"
    assert records._lab_of("lab_utils.checks.parts_check", parts_check.check_in_engine.__wrapped__,
                           (None, "04"), {}) == "04"


def test_likely_cause_is_kept_when_the_check_names_one():
    err = AssertionError("3 of 8 values differ\nLikely cause: the halves are swapped")
    assert records.mistake_line(err) == "3 of 8 values differ"
    assert records.likely_cause(err) == "the halves are swapped"
    assert records.likely_cause(AssertionError("shape (2,) but expected (3,)")) is None


def test_default_log_sits_next_to_my_engine_and_off_means_off(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_CHECKS_LOG", raising=False)
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    assert records.records_path() == tmp_path / ".lab_checks.jsonl"
    assert records.append({"check": "check_x", "t": 1.0})
    monkeypatch.setenv("LAB_CHECKS_LOG", "off")
    assert records.records_path() is None and not records.append({"check": "check_y", "t": 2.0})
    assert [r["check"] for r in records.read(tmp_path / ".lab_checks.jsonl")] == ["check_x"]


def test_a_log_owned_by_someone_else_is_never_written(log, monkeypatch):
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"check": "check_theirs", "t": 1.0}) + "\n")
    monkeypatch.setattr(os, "getuid", lambda: log.stat().st_uid + 1)  # this process is another Unix user
    assert not records.append({"check": "check_mine", "t": 2.0})
    assert [r["check"] for r in records.read(log)] == ["check_theirs"]


def test_torn_or_foreign_lines_are_skipped(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"check": "check_a", "t": 1}\n{"check": "check_b", "t"\nnot json\n[1, 2]\n{"check": 3, "t": 1}\n')
    assert [r["check"] for r in records.read(path)] == ["check_a"]
    assert records.read(tmp_path / "missing.jsonl") == []


def test_a_read_only_folder_does_not_break_the_check(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CHECKS_LOG", str(tmp_path / "not_a_dir" / "log.jsonl"))
    (tmp_path / "not_a_dir").write_text("a file where a folder should be")
    from lab_utils.checks import lab00

    lab00.check_rope(_good_rope, seed=1)  # passes, prints, and the failed write stays silent
    assert torch.is_grad_enabled()
