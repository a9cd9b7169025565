"""Help on demand for the labs' exercises, in three levels, and a record of what was asked.

    from lab_utils.hints import hint
    hint("02.grow")        # level 1: the idea
    hint("02.grow", 2)     # level 2: the steps, in words
    hint("02.grow", 3)     # level 3: pseudo-code (not Python: you still write the code)

An exercise id is `<lab>.<function>`; the learner copy of each exercise names its own. The exercise text states
the contract; the hints add help only when asked, so the learner thinks before reading more. Each request is
counted in `.lab_hints.json` in the notebook's folder (`LAB_HINTS_LOG` moves it), and
`python -m lab_utils student --stats` reports the counts per exercise.
"""
from __future__ import annotations

import json
import os
import tempfile
import textwrap
from pathlib import Path

from lab_utils.hint_texts import HINTS

LEVELS = {1: "the idea", 2: "the steps in words", 3: "pseudo-code"}
LOG_NAME = ".lab_hints.json"


def known_ids() -> list[str]:
    return sorted(HINTS)


def hint_text(exercise_id: str, level: int = 1) -> str:
    """The text of one hint (nothing recorded). ValueError for an unknown id or level."""
    if exercise_id not in HINTS:
        raise ValueError(f"no exercise {exercise_id!r}; the exercises with hints are: {', '.join(known_ids())}")
    if level not in LEVELS:
        raise ValueError(f"hint level {level!r}: the levels are 1 ({LEVELS[1]}), 2 ({LEVELS[2]}), 3 ({LEVELS[3]})")
    return HINTS[exercise_id][level - 1]


def hints_log(folder: str | Path | None = None) -> Path:
    """Where requests are counted: `LAB_HINTS_LOG`, else `.lab_hints.json` in `folder` (default: the current
    folder, which is the notebook's in Jupyter)."""
    env = os.environ.get("LAB_HINTS_LOG")
    if env:
        return Path(env).expanduser()
    return Path(folder if folder is not None else Path.cwd()) / LOG_NAME


def read_counts(path: str | Path) -> dict[str, dict[str, int]]:
    """{exercise id: {level as text: times asked}}; empty when nothing was asked yet (or the file is unreadable)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: {str(lv): int(n) for lv, n in v.items()} for k, v in data.items() if isinstance(v, dict)}


def record(exercise_id: str, level: int, path: str | Path | None = None) -> None:
    """Count one request (read, add one, write to a temporary file and rename it over the log)."""
    path = Path(path) if path is not None else hints_log()
    counts = read_counts(path)
    per_level = counts.setdefault(exercise_id, {})
    per_level[str(level)] = per_level.get(str(level), 0) + 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".lab_hints.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(counts, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only folder must not keep the learner from reading the hint
        pass


def hint(exercise_id: str, level: int = 1) -> None:
    """Print one level of help for an exercise (1 the idea, 2 the steps, 3 pseudo-code) and count the request."""
    text = hint_text(exercise_id, level)
    record(exercise_id, level)
    more = f'  (more: hint("{exercise_id}", {level + 1}))' if level < max(LEVELS) else ""
    if level < 3:  # prose: wrap it; pseudo-code keeps its lines
        text = "\n".join(textwrap.fill(line, 110, subsequent_indent="   " if line[:1].isdigit() else "")
                         for line in text.split("\n"))
    print(f"{exercise_id}, level {level} ({LEVELS[level]}):{more}\n{text}")


def hints_table(path: str | Path) -> str:
    """Hints asked per exercise, by level, with a total; one line when none were asked."""
    counts = read_counts(path)
    if not counts:
        return "none asked yet"
    rows = [f"{'exercise':28s} {'level 1':>7s} {'level 2':>7s} {'level 3':>7s} {'total':>6s}"]
    for ex_id in sorted(counts):
        n = [counts[ex_id].get(str(lv), 0) for lv in LEVELS]
        rows.append(f"{ex_id:28s} {n[0]:7d} {n[1]:7d} {n[2]:7d} {sum(n):6d}")
    rows.append(f"{'all exercises':28s} {'':7s} {'':7s} {'':7s} {sum(sum(v.values()) for v in counts.values()):6d}")
    return "\n".join(rows)
