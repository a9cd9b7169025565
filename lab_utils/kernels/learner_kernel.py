"""A learner's Triton kernel as an engine part: saved with its launcher into `my_engine/kernel.py`.

`learner_parts.submit` saves one function's source; a kernel part is two (the `@triton.jit` kernel and the
launcher that calls it), so this module writes the file: a header that finds Triton (`triton_env`), then per
part its kernel and its launcher under the part's name. `learner_parts` loads the file like any other part's.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import textwrap
from pathlib import Path
from typing import Callable

from lab_utils.course import learner_parts
from lab_utils.course.parts import PARTS

_HEADER = '''"""Your Triton kernels (lab 16), saved by `lab_utils.kernels.learner_kernel.save`. Edit them in the lab's
exercise cells (and run the check again): the engine loads this file."""
from __future__ import annotations

import math

import torch

from lab_utils.kernels import triton_env
from lab_utils.kernels.paged_decode_triton import check_inputs  # noqa: F401  (the lab's launchers call it)

triton, _why = triton_env.load()
if triton is None:
    raise ImportError(_why)
import triton.language as tl  # noqa: E402

jit = triton.jit  # the lab's cells write `@jit` (`triton_env.api()`)
'''
_MARK = "# --- part {name} ---"


def _source(obj) -> str:
    fn = getattr(obj, "fn", obj)  # a JITFunction keeps the Python function in .fn
    src = textwrap.dedent(inspect.getsource(fn)).strip("\n") + "\n"
    return "\n".join(line for line in src.split("\n")  # the lab's solution markers mean nothing here
                     if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^# --- part (\S+) ---\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts) - 1, 2)}


def save(name: str, launcher: Callable, kernels: tuple = (), helpers: tuple = ()) -> str:
    """Make `launcher` the engine's part `name` in this kernel and save it, its kernels and helpers to
    my_engine/kernel.py (the section of `name` replaced, the other part's kept). Returns the file's path."""
    part = PARTS[name]
    with contextlib.redirect_stdout(io.StringIO()):  # its line would say "not saved": this function saves it
        learner_parts.submit(name, launcher, save=False)
    folder = learner_parts.learner_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{part.component}.py"
    sections = _sections(path.read_text(encoding="utf-8")) if path.exists() else {}
    body = [_source(k) for k in (*kernels, *helpers)]
    body.append(re.sub(r"^def \w+\(", f"def {part.attr}(", _source(launcher), count=1, flags=re.M))
    sections[name] = "\n\n".join(b.rstrip() + "\n" for b in body)
    text = _HEADER + "".join(f"\n\n{_MARK.format(name=n)}\n{sections[n]}" for n in sorted(sections))
    path.write_text(text, encoding="utf-8")
    print(f"engine part {name} is now yours (saved: {path})")
    return str(path)


def show_reference_kernel() -> None:
    """The engine's own Triton kernel (`_decode_jit.py`), rendered like `learner_parts.show_reference`: only once
    both kernel parts have passed their checks and been saved (it does both exercises' work, so it would give
    the second away after the first)."""
    missing = [n for n in ("kernel.paged_decode", "kernel.paged_decode_split") if learner_parts.load_part(n) is None]
    if missing:
        print(f"The engine's own kernel is shown here once yours have passed their checks ({', '.join(missing)} "
              f"not saved yet).")
        return
    src = Path(__file__).with_name("_decode_jit.py").read_text(encoding="utf-8")
    src = src[src.index("@triton.jit"):]
    learner_parts.show_source("The engine's own kernel (lab_utils/kernels/_decode_jit.py; `paged_decode_triton.py` "
                              "launches it):", src)
