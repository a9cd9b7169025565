"""A lab's settings: its papermill parameters, the environment's switches, and sizes that shrink in SMOKE mode.

A lab's `parameters` cell holds plain literals only, so that papermill's injected cell (which lands right after
it) overrides them; a size that depends on `SMOKE` is `None` there. The next cell derives the rest:

    SMOKE = SMOKE or env_flag("LAB_SMOKE")            # CI and `make test` run every lab with LAB_SMOKE=1
    INTERACTIVE = INTERACTIVE and env_flag("LAB_INTERACTIVE", default=True)
    DTYPE = env_choice("LAB_DTYPE", DTYPE)
    sized = sizer(SMOKE)
    NUM_PROMPTS = sized(NUM_PROMPTS, smoke=64, full=128)  # a value passed as a parameter wins

so `papermill -p SMOKE True`, `LAB_SMOKE=1` and `SMOKE = True` typed in the cell all give the SMOKE sizes.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_flag(name: str, default: bool = False) -> bool:
    """The environment variable `name` read as a switch ("1"/"true"/"yes"/"on" or "0"/"false"/"no"/"off");
    `default` when it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in _TRUE | _FALSE:
        raise ValueError(f"{name}={os.environ[name]!r}: use 1 or 0")
    return value in _TRUE


def env_choice(name: str, value: str, auto: str = "auto") -> str:
    """`value`, unless it is still `auto` and the environment variable `name` says otherwise (a parameter passed
    explicitly wins over the environment)."""
    if value != auto:
        return value
    return os.environ.get(name, "").strip() or value


def sizer(smoke_mode: bool) -> Callable[..., T]:
    """`sized(value, smoke=..., full=...)`: `value` when a parameter set it, else the SMOKE or the full default."""
    def sized(value: T | None, smoke: T, full: T) -> T:
        if value is not None:
            return value
        return smoke if smoke_mode else full

    return sized
