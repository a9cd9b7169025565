"""Your engine: the parts you write in the labs, kept as files and run by the real engine.

Each lab's exercise is a part of `LLMEngine` (see `lab_utils.course.parts`). When its check passes, the lab
calls `learner_parts.submit(name, fn)`: the function goes into this kernel's registry and its source into a small
package of your own, `my_engine/` next to the notebooks (one file per component: `scheduler.py`,
`block_manager.py`, `attention.py`), the way tiny-llm keeps a student package beside its reference one. Later
labs load those files, so the engine you measure in lab 04 runs the scheduler you wrote in lab 01 and the block
allocator you wrote in lab 02; a part you skipped falls back to the reference, and `learner_parts.parts()` says so.

    parts = learner_parts.parts(upto="02")                 # yours where you wrote them, else the reference
    engine = LLMEngine(model, learner_parts.engine_config("02"), parts=parts)

`engine_config(lab)` is the engine as of that lab: lab 01 has what lab 01 taught (one contiguous KV region per
request, whole prompts, no prefix cache); each later lab switches on what it teaches.
`LAB_LEARNER_DIR` moves `my_engine/` elsewhere (tests use a temporary folder).
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import textwrap
from pathlib import Path
from typing import Callable

from lab_utils.engine.config import EngineConfig
from lab_utils.course.parts import PARTS, EngineParts, check_signature

_REGISTRY: dict[str, Callable] = {}  # parts submitted in this kernel (name -> function)

_HEADER = '''"""Your {component} parts, written in the labs and saved by `lab_utils.course.learner_parts.submit`.
Edit them in the lab's exercise cell (and submit again), or here; the engine loads this file."""
from __future__ import annotations

import json
import math
from collections import deque

import torch
import torch.nn.functional as F

from lab_utils.engine.request import Request, Status
from lab_utils.engine.scheduler import SchedulerOutput
'''


def learner_dir() -> Path:
    return Path(os.environ.get("LAB_LEARNER_DIR") or Path.cwd() / "my_engine")


def _source(fn: Callable) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _saved_sources(path: Path) -> dict[str, str]:
    """Top-level functions of a saved file, by name (their source text)."""
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8")
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^(?:async )?def (\w+)\(", text, re.M)]
    out = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[name] = text[pos:end].rstrip() + "\n"
    return out


def submit(name: str, fn: Callable, save: bool = True) -> None:
    """Make `fn` the engine's part `name` from now on (this kernel), and save its source to my_engine/."""
    check_signature(name, fn)
    part = PARTS[name]
    _REGISTRY[name] = fn
    where = "this notebook only (its source could not be read)"
    src = _source(fn)
    if save and src is not None:
        folder = learner_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{part.component}.py"
        funcs = _saved_sources(path)
        src = "\n".join(line for line in src.split("\n")  # the lab's solution markers mean nothing here
                        if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
        funcs[part.attr] = re.sub(r"^(async )?def \w+\(", lambda m: f"{m.group(1) or ''}def {part.attr}(", src, count=1,
                                  flags=re.M)
        body = "\n\n".join(funcs[k].rstrip() + "\n" for k in sorted(funcs))
        path.write_text(_HEADER.format(component=part.component) + "\n\n" + body, encoding="utf-8")
        where = str(path)
    print(f"engine part {name} is now yours (saved: {where})")


def load_part(name: str) -> Callable | None:
    """Your saved version of one part (from my_engine/), or None: for code that runs in another process
    (tensor-parallel workers, the prefill/decode workers), which cannot see this kernel's registry."""
    return _REGISTRY.get(name) or _load_saved(PARTS[name].component).get(name)


def saved_parts(names, refs: dict[str, Callable], what: str) -> tuple[dict[str, Callable], list[str]]:
    """For code in another process (TP ranks, P/D workers): {part: function} for every part in `refs`, the
    learner's saved version (from my_engine/, wrapped so errors name the part) for those in `names`, the
    reference for the rest; and the sorted names that are the learner's."""
    from lab_utils.course.parts import EngineParts

    fns = {}
    for name in names:
        if name not in refs:
            raise ValueError(f"learner_parts: {name!r} is not a {what} part; use {sorted(refs)}")
        fn = load_part(name)
        if fn is None:
            raise ValueError(f"learner_parts asks for your {name}, but {learner_dir()} has none: run the "
                             f"lab's check cell (it saves your function with learner_parts.submit)")
        fns[name] = fn
    parts = EngineParts(fns)
    return {n: parts.function(n, ref) for n, ref in refs.items()}, sorted(fns)


def _load_saved(component: str) -> dict[str, Callable]:
    path = learner_dir() / f"{component}.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"my_engine_{component}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a broken saved file must not stop the lab: say so, use the reference
        print(f"could not load {path} ({type(err).__name__}: {err}); using the reference parts instead")
        return {}
    return {name: getattr(module, PARTS[name].attr) for name in PARTS
            if PARTS[name].component == component and callable(getattr(module, PARTS[name].attr, None))}


def parts(upto: str | None = None, only: list[str] | None = None, quiet: bool = False) -> EngineParts:
    """Your parts of the labs up to `upto` (this kernel's first, then my_engine/), the reference elsewhere.
    Prints which version of each part the engine will run, unless `quiet`."""
    chosen: dict[str, Callable] = {}
    origins: dict[str, str] = {}
    for component in {p.component for p in PARTS.values()}:
        for name, fn in _load_saved(component).items():
            chosen[name], origins[name] = fn, f"yours ({learner_dir().name}/{component}.py)"
    for name, fn in _REGISTRY.items():
        chosen[name], origins[name] = fn, "yours (this notebook)"
    keep = {n: f for n, f in chosen.items()
            if (upto is None or PARTS[n].lab <= upto) and (only is None or n in only)
            and (PARTS[n].carry or upto is None or PARTS[n].lab == upto)}
    result = EngineParts(keep, {n: origins[n] for n in keep})
    if not quiet:
        print(parts_table(result, chosen, upto, only))
    return result


def parts_table(result: EngineParts, written, upto: str | None = None, only=None) -> str:
    """The table `parts()` prints: one line per part up to `upto`, whose version the engine runs and, where it
    is the reference, why (not written yet, or which rule left the learner's out)."""
    lines = ["the engine runs:"]
    for line in sorted(result.describe().splitlines(), key=lambda line: line.split()[1]):  # by lab
        name, lab = line.split()[2], line.split()[1]
        if upto is not None and lab > upto:
            continue
        if result.is_learners(name):
            why = ""
        elif name not in written:
            why = "   (you have not written it yet)"
        elif only is not None and name not in only:
            why = "   (yours is saved; left out of this engine by only=)"
        else:
            why = "   (yours ran in its lab; later labs use the engine's fast version)"
        lines.append(line + why)
    return "\n".join(lines)


def forget(name: str | None = None) -> None:
    """Drop this kernel's submitted parts (all, or one); saved files stay."""
    if name is None:
        _REGISTRY.clear()
    else:
        _REGISTRY.pop(name, None)


# the engine as of each lab: what that lab and the ones before it taught
_ENGINE_AS_OF = {
    "01": dict(scheduler="continuous", kv_layout="contiguous", enable_chunked_prefill=False,
               enable_prefix_caching=False),
    "02": dict(scheduler="continuous", kv_layout="paged", enable_chunked_prefill=False,
               enable_prefix_caching=False),
    "03": dict(scheduler="token_budget", kv_layout="paged", enable_chunked_prefill=True,
               enable_prefix_caching=False),
    "04": dict(scheduler="token_budget", kv_layout="paged", enable_chunked_prefill=True,
               enable_prefix_caching=True),
}


def engine_config(lab: str, **overrides) -> EngineConfig:
    """`EngineConfig` of the engine as the course has built it by the end of `lab` ("01" .. "04"; later labs
    start from "04"), with `overrides` on top (sizes, or a switch a lab compares). In a workshop the hub sets
    `LAB_KV_CACHE_MEMORY_BYTES` (this learner's share of the box, `lab_utils.workshop.sizing`): it is the KV budget
    unless the lab sizes the KV pool itself."""
    key = max(k for k in _ENGINE_AS_OF if k <= max(lab, "01"))
    room = os.environ.get("LAB_KV_CACHE_MEMORY_BYTES")
    if room and "kv_cache_memory_bytes" not in overrides and "num_gpu_blocks" not in overrides:
        if not room.isdigit() or int(room) <= 0:
            raise ValueError(f"LAB_KV_CACHE_MEMORY_BYTES={room!r}: a positive whole number of bytes")
        overrides = {**overrides, "kv_cache_memory_bytes": int(room)}
    return EngineConfig(**{**_ENGINE_AS_OF[key], **overrides})


def show_reference(name: str, reveal_only_after_yours: bool = True) -> None:
    """Show the engine's own version of a part (the code you just rebuilt), as rendered source: only once your
    version has passed its check and been saved, so it never gives the exercise away."""
    from lab_utils.paths import REPO_ROOT

    part = PARTS[name]
    if reveal_only_after_yours and load_part(name) is None:
        print(f"The engine's own {part.attr} is shown here once yours has passed its check (it is not saved yet).")
        return
    obj = part.reference()
    src = textwrap.dedent(inspect.getsource(obj))
    file = Path(inspect.getsourcefile(obj)).resolve().relative_to(REPO_ROOT)
    line = inspect.getsourcelines(obj)[1]
    show_source(f"The engine's own `{part.attr}` ({file}, line {line}):", src)


def show_source(title: str, src: str) -> None:
    """`src` under `title`: rendered as Markdown in a notebook, printed elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(f"{title}\n\n```python\n{src}```"))
            return
    except ImportError:
        pass
    print(title)
    print(src)
