"""The room's gradebook from the learners' own check records: `python -m lab_utils grade HOMES --csv out.csv`.

HOMES holds one folder per learner (their home, as the hub makes them); the learner is that folder's name, never
a field of a record. For each learner and check: attempts, the last result (passed, or the mistake's first line),
when it first passed and after how many attempts, and, on the learner's current exercise (the check of their
latest record, while it is failing), how long they have been stuck on it: from their first attempt since it
last passed until now.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.workshop.records import LOG_NAME, read

MAX_DEPTH = 3  # home/.lab_checks.jsonl, home/student/.lab_checks.jsonl, home/student/labs/.lab_checks.jsonl
COLUMNS = ["learner", "lab", "check", "attempts", "last_result", "last_time", "first_pass_time",
           "attempts_to_pass", "stuck_min", "likely_cause"]


@dataclass
class Cell:
    """One learner's history on one check."""
    lab: str
    check: str
    attempts: int = 0
    passed: bool = False
    last_result: str = ""
    first_t: float = 0.0
    last_t: float = 0.0
    first_pass_t: float | None = None
    attempts_to_pass: int | None = None
    likely_cause: str | None = None
    stuck_s: float | None = None  # only on the learner's current exercise while it fails


@dataclass
class Learner:
    name: str
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    current: tuple[str, str] | None = None
    stuck_s: float = 0.0


def find_logs(home: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """The check logs under one home, hidden folders (.cache, .local) and symlinks not followed."""
    out = []
    for root, dirs, files in os.walk(home):
        level = len(Path(root).relative_to(home).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "node_modules" and level < depth
                         and not os.path.islink(os.path.join(root, d)))
        if LOG_NAME in files:
            out.append(Path(root) / LOG_NAME)
    return out


def learner_from_records(name: str, recs: list[dict], now: float) -> Learner:
    """Fold one learner's records (any order) into cells, and the time stuck on the current exercise."""
    me = Learner(name)
    recs = sorted(recs, key=lambda r: r["t"])
    for r in recs:
        key = (str(r.get("lab", "?")), r["check"])
        c = me.cells.setdefault(key, Cell(*key))
        c.attempts += 1
        c.first_t = c.first_t or r["t"]
        c.passed = bool(r.get("passed"))
        c.last_result = "passed" if c.passed else str(r.get("mistake") or "failed")
        c.last_t = r["t"]
        c.likely_cause = None if c.passed else r.get("cause")
        if c.passed and c.first_pass_t is None:
            c.first_pass_t, c.attempts_to_pass = r["t"], c.attempts
    if recs:
        last = recs[-1]
        me.current = (str(last.get("lab", "?")), last["check"])
        if not last.get("passed"):
            since = last["t"]
            for r in reversed(recs):  # back to the first attempt since this check last passed
                if (str(r.get("lab", "?")), r["check"]) == me.current:
                    if r.get("passed"):
                        break
                    since = r["t"]
            me.stuck_s = max(0.0, now - since)
            me.cells[me.current].stuck_s = me.stuck_s
    return me


def room(homes: str | Path, now: float | None = None) -> list[Learner]:
    """Every learner folder under `homes` (with or without records yet), by name."""
    now = time.time() if now is None else now
    homes = Path(homes)
    if not homes.is_dir():
        raise ValueError(f"{homes} is not a folder of learner homes")
    out = []
    for home in sorted(p for p in homes.iterdir() if p.is_dir() and not p.name.startswith(".")):
        recs = [r for log in find_logs(home) for r in read(log)]
        out.append(learner_from_records(home.name, recs, now))
    return out


def checks_of(learners: list[Learner]) -> list[tuple[str, str]]:
    """The room's checks, by lab, then in the order the room first ran them."""
    first: dict[tuple[str, str], float] = {}
    for me in learners:
        for key, c in me.cells.items():
            first[key] = min(first.get(key, float("inf")), c.first_t)
    return sorted(first, key=lambda k: (k[0], first[k]))


def _iso(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def rows(learners: list[Learner]) -> list[dict]:
    out = []
    for me in learners:
        for (lab, check), c in sorted(me.cells.items()):
            out.append({"learner": me.name, "lab": lab, "check": check, "attempts": c.attempts,
                        "last_result": c.last_result, "last_time": _iso(c.last_t),
                        "first_pass_time": _iso(c.first_pass_t),
                        "attempts_to_pass": "" if c.attempts_to_pass is None else c.attempts_to_pass,
                        "stuck_min": "" if c.stuck_s is None else round(c.stuck_s / 60, 1),
                        "likely_cause": c.likely_cause or ""})
    return out


def to_csv(learners: list[Learner]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows(learners))
    return buf.getvalue()


def summary(learners: list[Learner]) -> str:
    """One line a learner: checks passed, and the exercise they are on (stuck for how long)."""
    lines = []
    for me in learners:
        done = sum(c.passed for c in me.cells.values())
        where = "no checks run yet"
        if me.current:
            c = me.cells[me.current]
            state = "passed" if c.passed else f"failing for {me.stuck_s / 60:.0f} min: {c.last_result[:70]}"
            where = f"on {me.current[0]}/{me.current[1]} ({state})"
        lines.append(f"{me.name:16s} {done:3d} passed  {where}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    learners = room(args.homes)
    print(summary(learners))
    if args.csv:
        Path(args.csv).write_text(to_csv(learners), encoding="utf-8")
        print(f"gradebook: {len(rows(learners))} rows for {len(learners)} learners -> {args.csv}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("grade", help="the room's gradebook (learner x check) from the learners' check records")
    p.add_argument("homes", help="folder with one home folder per learner (e.g. /home)")
    p.add_argument("--csv", help="write the gradebook here (one row per learner and check)")
    p.set_defaults(func=_run)
