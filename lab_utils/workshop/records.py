"""Every check a learner runs leaves one line in the learner's own log: lab, check, passed or the mistake, time.

The checks of `lab_utils.checks.labNN` and `parts_check` are wrapped once, where they are defined
(`record_checks(globals())` at the end of each module), so no lab cell changes. The log is JSON lines,
`.lab_checks.jsonl` next to the learner's `my_engine/` folder (`lab_utils.course.learner_parts.learner_dir()`), the
notebook's folder in Jupyter. `LAB_CHECKS_LOG` moves it; `LAB_CHECKS_LOG=off` turns recording off (the test
suite does). The path comes only from this process's own environment and folder, a line carries no user name
(the gradebook takes the learner from whose home the log is in), and a log owned by another Unix user is never
written: a learner can record only their own results.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

LOG_NAME = ".lab_checks.jsonl"
OFF = {"", "0", "off", "false", "no", "none"}
_depth = threading.local()  # a check that calls another check records once, as the outer one


def records_path() -> Path | None:
    """Where this process records: `LAB_CHECKS_LOG`, else `.lab_checks.jsonl` beside `my_engine/`; None when off."""
    env = os.environ.get("LAB_CHECKS_LOG")
    if env is not None:
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    from lab_utils.course.learner_parts import learner_dir

    return learner_dir().parent / LOG_NAME


def mistake_line(err: BaseException) -> str:
    """The first line of what the check said (an AssertionError names the mistake); other errors keep their type."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(err, AssertionError) else f"{type(err).__name__}: {first}".rstrip(": ")


def likely_cause(err: BaseException) -> str | None:
    """The check's diagnosis when it had evidence for one: its "Likely cause:" / "likely mistake:" text."""
    m = re.search(r"likely (?:cause|mistake):\s*(.+)", str(err), re.IGNORECASE)
    return m.group(1).strip() if m else None


def append(record: dict, path: Path | None = None) -> bool:
    """Append one record (one line, one write: concurrent kernels do not interleave). False when not written."""
    path = path if path is not None else records_path()
    if path is None:
        return False
    try:
        if path.exists() and path.stat().st_uid != os.getuid():
            return False  # someone else's log: never written for another user
        path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return True
    except OSError:  # a read-only folder must not keep the learner from seeing the check's answer
        return False


def read(path: str | Path) -> list[dict]:
    """The records of one log, oldest first; lines that are not a record (a torn write, an edit) are skipped."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("check"), str) and isinstance(rec.get("t"), (int, float)):
            out.append(rec)
    return out


def _lab_of(module: str, fn: Callable, args: tuple, kwargs: dict) -> str:
    m = re.search(r"lab(\d\d)$", module)
    if m:
        return m.group(1)
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return "?"
    if isinstance(bound.get("lab"), str):
        return bound["lab"]
    name = bound.get("name")
    if isinstance(name, str):
        from lab_utils.course.parts import PARTS

        if name in PARTS:
            return PARTS[name].lab
    return "?"


def recorded(fn: Callable, module: str | None = None) -> Callable:
    """`fn` that also records its outcome (passed, or the first line of the error it raised) in the learner's log."""
    module = module or fn.__module__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        start = time.time()
        outcome: tuple[bool, str | None, str | None] | None = None
        try:
            result = fn(*args, **kwargs)
            outcome = (True, None, None)
            return result
        except Exception as err:  # recorded and raised again; KeyboardInterrupt is not a result
            outcome = (False, mistake_line(err), likely_cause(err))
            raise
        finally:
            _depth.n = depth
            if depth == 0 and outcome is not None:
                append({"lab": _lab_of(module, fn, args, kwargs), "check": fn.__name__, "passed": outcome[0],
                        "mistake": outcome[1], "cause": outcome[2], "t": round(start, 3), "seconds": round(time.time() - start, 3),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start))})

    wrapper.__recorded__ = True
    return wrapper


def record_checks(namespace: dict) -> list[str]:
    """Wrap every `check_*` function defined in the module whose globals are `namespace`; returns their names."""
    module = namespace["__name__"]
    names = []
    for name, obj in list(namespace.items()):
        if (name.startswith("check_") and inspect.isfunction(obj) and obj.__module__ == module
                and not getattr(obj, "__recorded__", False)):
            namespace[name] = recorded(obj, module)
            names.append(name)
    return names
