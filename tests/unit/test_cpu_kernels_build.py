"""The CPU kernels' build starts every time: a build killed half-way does not hang later starts, a wait for
another builder is bounded, and each Python environment builds once into its own folder, then only loads.

The slow tests compile the kernels for real (about a minute each on 2 cores) into a cache of their own
(`LAB_UTILS_CACHE`), in subprocesses, as a learner's kernel or a server would."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from lab_utils.engine.accel import cpu_kernels as ck

START = ("import time\n"
         "from lab_utils.engine.accel.cpu_kernels import cpu_kernels, cpu_kernels_status, _build_dir\n"
         "t = time.perf_counter(); m = cpu_kernels()\n"
         "print('STATUS', cpu_kernels_status()); print('DIR', _build_dir()); print('SECONDS', time.perf_counter() - t)\n")
BUILD_LIMIT_S = 600  # a normal build is 30-90 s on 2 idle cores; a loaded CI machine is slower


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the venv's ninja
    env = dict(os.environ, LAB_UTILS_CACHE=str(cache), HF_HUB_OFFLINE="1", PATH=path)
    env.pop("LAB_CPU_KERNELS", None)
    return env


def _start(python: str, cache: Path) -> dict:
    """One engine start in a fresh process: what it printed, where it built, how long the kernels took."""
    done = subprocess.run([python, "-c", START], env=_env(cache), capture_output=True, text=True,
                          timeout=BUILD_LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in
               ("STATUS", "DIR", "SECONDS"))
    return {"status": out["STATUS"], "dir": Path(out["DIR"]), "seconds": float(out["SECONDS"]),
            "stderr": done.stderr, "compiled": "compiling the CPU kernels once" in done.stderr}


def _library(build: Path) -> Path:
    return next(build.glob(f"{ck.NAME}*.so"))


# --- fast: the bounded wait ----------------------------------------------------------------------------------

def test_a_wait_for_another_builder_is_bounded_and_names_the_file(tmp_path):
    path = tmp_path / "build.lock"
    with open(path, "w") as holder, open(path, "w") as waiter:
        ck.fcntl.flock(holder, ck.fcntl.LOCK_EX)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match=str(tmp_path)) as err:
            ck._lock_exclusively(waiter, path, 0.5)
        assert time.monotonic() - t < 5
        assert "delete" in str(err.value)


def test_an_engine_start_that_cannot_get_the_lock_keeps_pytorch_ops(tmp_path, monkeypatch):
    """A start that waited its limit is not stuck: it warns and the engine runs on PyTorch's ops."""
    monkeypatch.setenv("LAB_UTILS_CACHE", str(tmp_path))
    monkeypatch.delenv("LAB_CPU_KERNELS", raising=False)
    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(ck, "LOCK_TIMEOUT_S", 0.3)
    build = ck._build_dir()
    build.mkdir(parents=True)
    with open(build / "build.lock", "w") as holder:
        ck.fcntl.flock(holder, ck.fcntl.LOCK_EX)
        with pytest.warns(UserWarning, match="TimeoutError"):
            assert ck.cpu_kernels() is None
    assert "build.lock" in ck.cpu_kernels_status()


def test_the_build_folder_is_keyed_on_the_python_environment(monkeypatch):
    """Two environments (two torch installs: other include paths) get two folders; one environment, one."""
    here = ck._build_dir()
    assert ck._build_dir() == here
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/other/env/site-packages/torch/include"])
    assert ck._build_dir() != here
    assert ck._build_dir().parent == here.parent


# --- slow: real builds in subprocesses -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the CPU kernels")
    return tmp_path_factory.mktemp("kernel_cache")


@pytest.mark.slow
def test_a_build_killed_half_way_does_not_hang_the_next_start(cache):
    """Killed while compiling (a server stopped, a kernel restarted), the builder leaves PyTorch's `lock` in the
    build folder; PyTorch alone waits for it forever. The next start removes it, says so, and builds."""
    proc = subprocess.Popen([sys.executable, "-c", START], env=_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(cache.glob("torch_extensions/*/lock")):
            assert proc.poll() is None, f"the first start ended before it built: {proc.communicate()}"
            assert time.monotonic() < deadline, "the first start never began its build"
            time.sleep(0.1)
        time.sleep(2)  # well into the compile
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    (build,) = cache.glob("torch_extensions/*")
    assert (build / ck.TORCH_LOCK).exists(), "the killed build should have left PyTorch's lock behind"
    assert not (build / ck.BUILT_STAMP).exists()

    after = _start(sys.executable, cache)
    assert after["status"].startswith("compiled CPU kernels"), after
    assert "removed the lock of an interrupted CPU-kernel build" in after["stderr"]
    assert after["compiled"] and "compiled in" in after["stderr"]
    assert not (build / ck.TORCH_LOCK).exists()

    # the same leftover in a finished build (killed during a later load) costs a load, not a build
    (build / ck.TORCH_LOCK).write_text("")
    again = _start(sys.executable, cache)
    assert "removed the lock" in again["stderr"] and not again["compiled"], again["stderr"]
    print(f"start after a killed build: {after['seconds']:.1f} s (a build); a built start with a stale lock: "
          f"{again['seconds']:.1f} s")


def _second_environment(root: Path) -> str:
    """Another Python environment over the same packages: a venv whose `torch` is a link to this one's (so its
    include paths differ, as two installs' would) and whose other packages are this one's."""
    base = Path(sysconfig.get_paths()["stdlib"]).parents[1] / "bin" / "python3"
    base = base if base.exists() else Path(sys._base_executable)
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    import torch

    (site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    here = sysconfig.get_paths()["purelib"]
    (site / "zz_course.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return str(root / "bin" / "python")


@pytest.mark.slow
def test_two_environments_alternating_build_once_each_then_only_load(cache, tmp_path):
    other = _second_environment(tmp_path / "env_b")
    runs = [(name, _start(python, cache)) for name, python in
            [("a", sys.executable), ("b", other), ("a", sys.executable), ("b", other)]]
    folders = {name: run["dir"] for name, run in runs}
    assert folders["a"] != folders["b"], "two environments must not share (and rebuild) one build folder"
    for name, run in runs:
        assert run["status"].startswith("compiled CPU kernels"), (name, run)
        assert run["dir"] == folders[name]
    libs = {name: _library(folders[name]).stat().st_mtime for name in folders}
    # the later start of each environment only loads: no build message, the library untouched
    for name, run in runs[2:]:
        assert not run["compiled"], f"environment {name} compiled again: {run['stderr'][-500:]}"
        assert _library(run["dir"]).stat().st_mtime == libs[name]
        assert run["seconds"] < 30, f"a start with the kernels built took {run['seconds']:.1f} s"
    assert runs[1][1]["compiled"], "the second environment's first start should build its own copy"
    print("starts (env, seconds, compiled):", [(n, round(r["seconds"], 1), r["compiled"]) for n, r in runs])
