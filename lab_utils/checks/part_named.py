"""Rejections that name the part: every failure of a part's check starts with the part, its lab and its file.

Labs 01-04 build each message with `parts_check.where`; the checks of labs 05-15 run their cases inside
`names_part(...)`, which puts the same label in front of any AssertionError raised inside (unless the message
already names it), so a learner reads which function failed and where it is saved (`my_engine/<component>.py`)
before the case and the cause. The exception keeps its class and attributes (a check's `part` / `diagnosis`).
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from lab_utils.course.parts import PARTS


def label(*names: str) -> str:
    """'spec.rollback (lab 07, my_engine/spec.py)'; parts saved in one file share one label."""
    from lab_utils.course.learner_parts import learner_dir

    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise KeyError(f"unknown engine part(s) {unknown or names}; the parts are: {', '.join(PARTS)}")
    files = sorted({f"{learner_dir().name}/{PARTS[n].component}.py" for n in names})
    labs = sorted({PARTS[n].lab for n in names})
    return f"{' and '.join(names)} (lab {', '.join(labs)}, {', '.join(files)})"


@contextlib.contextmanager
def names_part(*names: str) -> Iterator[None]:
    """Run a part's check; an AssertionError inside comes out with the part's label in front."""
    try:
        yield
    except AssertionError as err:
        text = label(*names)
        if re.match(r"[\w.]+ \(lab \d\d", str(err)) or f"your {names[0]} (lab" in str(err):
            raise  # already names a part or an exercise, its lab and where it lives
        try:
            named = type(err)(f"{text}: {err}")
        except Exception:  # noqa: BLE001 - an AssertionError subclass with another constructor
            named = AssertionError(f"{text}: {err}")
        named.__dict__.update(err.__dict__)
        raise named.with_traceback(err.__traceback__) from None


def checks_part(*names: str):
    """Decorator: the check of the parts `names`, whose rejections name them (see `names_part`)."""
    import functools

    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            with names_part(*names):
                return check(*args, **kwargs)

        return run

    return wrap
