"""`prepare` run many times at once on one cache: one process builds, the others wait and use its folder; no
half-written folder is ever seen, no temporary folder is left behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each child prepares <root>/models/m with a build that takes a while and logs who built; prints what it got.
CHILD = r"""
import os, sys, time
from pathlib import Path
from lab_utils.models.prepare import build_once
root = Path(sys.argv[1])
def build(tmp):
    with open(root / "builds.log", "a") as f:
        f.write(f"{os.getpid()}\n")
    for name in ("a.bin", "b.bin", "config.json"):
        time.sleep(0.3)
        (tmp / name).write_text(name)
ready = lambda p: all((p / n).exists() for n in ("a.bin", "b.bin", "config.json"))
out = build_once(root / "models" / "m", build, ready, verbose=False)
print(out, sorted(x.name for x in out.iterdir()))
"""


def _start(args, env=None):
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def test_four_at_once_build_once_and_share_the_folder(tmp_path):
    procs = [_start([sys.executable, "-c", CHILD, str(tmp_path)]) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    want = f"{tmp_path / 'models' / 'm'} ['a.bin', 'b.bin', 'config.json']"
    assert [o.strip().splitlines()[-1] for o in outs] == [want] * 4, outs
    assert len((tmp_path / "builds.log").read_text().split()) == 1, "exactly one process built the folder"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m", "m.lock"], "no temporary folder left"
    assert oct((tmp_path / "models" / "m").stat().st_mode & 0o777) == "0o755"


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    from lab_utils.models.prepare import build_once

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_text("x")
        raise RuntimeError("disk full")

    ready = lambda p: (p / "ok").exists()  # noqa: E731
    (tmp_path / "m.tmp-killed").mkdir()  # what a build killed half-way leaves
    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path / "m", broken, ready, verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.lock"]
    out = build_once(tmp_path / "m", lambda tmp: (tmp / "ok").write_text("1"), ready, verbose=False)
    assert (out / "ok").exists()


@pytest.mark.slow
def test_four_real_prepares_at_once_on_an_empty_cache(tmp_path):
    """The real `python -m lab_utils prepare` (dequantizes SmolLM2-135M) four times at once on an empty cache."""
    pytest.importorskip("gguf")
    from lab_utils.models.prepare import find_gguf

    try:
        find_gguf()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    env = {"LAB_UTILS_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    procs = [_start([sys.executable, "-m", "lab_utils", "prepare"], env) for _ in range(4)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    built = [o for o in outs if "built in" in o]
    assert len(built) == 1, outs
    folder = tmp_path / "models" / "smollm2-135m"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2-135m", "smollm2-135m.lock"]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 10
