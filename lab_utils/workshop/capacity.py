"""What one learner's kernel holds through the labs: peak memory and CPU, measured, for the room's arithmetic.

    python -m lab_utils.workshop.capacity --only 00,01,02,03,04 --smoke

runs the labs as `lab_utils run-labs` does (one kernel a lab, the solved notebooks, so the engine work is a
learner's after the exercises), samples every kernel process twice a second (resident set RSS, and USS: the pages
only that process holds, what one more learner adds when the libraries' pages are shared), and prints per lab the
peak RSS and USS, CPU seconds and wall seconds; then the same for an idle Jupyter server. `lab_utils.workshop.sizing`
takes its KERNEL_BASE from these figures (docs/INSTRUCTOR.md, "Capacity").
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass
class Peak:
    name: str
    rss: int = 0
    uss: int = 0
    cpu_s: float = 0.0
    start: float = field(default_factory=time.time)
    end: float = 0.0

    def row(self) -> str:
        return (f"{self.name:28s} {self.rss / MiB:9.0f} {self.uss / MiB:9.0f} {self.cpu_s:8.1f} "
                f"{self.end - self.start:8.1f}")


HEADER = f"{'process':28s} {'RSS MiB':>9s} {'USS MiB':>9s} {'CPU s':>8s} {'wall s':>8s}"


def sample(root_pid: int, match: str, stop: threading.Event, every_s: float = 0.5) -> list[Peak]:
    """Peaks of every descendant of `root_pid` whose command line contains `match`, in order of appearance."""
    import psutil

    seen: dict[int, Peak] = {}
    root = psutil.Process(root_pid)
    while not stop.is_set():
        try:
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                if p.pid not in seen:
                    if match not in " ".join(p.cmdline()):
                        continue
                    seen[p.pid] = Peak(f"kernel {len(seen) + 1}")
                mem, cpu = p.memory_full_info(), p.cpu_times()
                peak = seen[p.pid]
                peak.rss, peak.uss = max(peak.rss, mem.rss), max(peak.uss, mem.uss)
                peak.cpu_s, peak.end = cpu.user + cpu.system, time.time()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        stop.wait(every_s)
    return list(seen.values())


def measure_labs(labs: str, smoke: bool, out: str, kv_bytes: int | None = None) -> list[Peak]:
    """Run the labs as `run-labs` does, with the room's KV budget when `kv_bytes` is given (as the hub sets it)."""
    cmd = [sys.executable, "-m", "lab_utils", "run-labs", "--device", "cpu", "--only", labs, "--out", out]
    env = dict(os.environ, LAB_CHECKS_LOG="off", LAB_LEARNER_DIR=os.path.join(out, "my_engine"))
    if kv_bytes is not None:
        env["LAB_KV_CACHE_MEMORY_BYTES"] = str(kv_bytes)
    proc = subprocess.Popen(cmd + (["--smoke"] if smoke else []), env=env)
    stop, result = threading.Event(), []
    t = threading.Thread(target=lambda: result.extend(sample(proc.pid, "ipykernel", stop)), daemon=True)
    t.start()
    rc = proc.wait()
    stop.set()
    t.join()
    if rc:
        raise SystemExit(f"run-labs exited {rc}")
    for peak, lab in zip(result, labs.split(",")):
        peak.name = f"kernel, lab {lab}"
    return result


def measure_server(settle_s: float = 20.0) -> Peak:
    """An idle Jupyter server (what the hub starts for a learner before any kernel)."""
    import psutil

    with tempfile.TemporaryDirectory() as root:
        proc = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.port=0",
                                 "--ServerApp.token=capacity", f"--ServerApp.root_dir={root}",
                                 *(["--allow-root"] if os.geteuid() == 0 else [])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(settle_s)
            p = psutil.Process(proc.pid)
            mem, cpu = p.memory_full_info(), p.cpu_times()
            now = time.time()
            return Peak("jupyter server, idle", mem.rss, mem.uss, cpu.user + cpu.system, start=now - settle_s, end=now)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="00,01,02,03,04", help="labs, comma-separated (default 00-04)")
    p.add_argument("--smoke", action="store_true", help="SMOKE sizes")
    p.add_argument("--kv-bytes", type=int, default=None, help="LAB_KV_CACHE_MEMORY_BYTES for the kernels (the "
                   "room's KV budget; default: the engine's own, 1 GiB on the CPU)")
    p.add_argument("--out", default=None, help="where the executed notebooks go (default: a temporary folder)")
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="capacity-")
    server = measure_server()
    peaks = measure_labs(args.only, args.smoke, out, args.kv_bytes)
    print(HEADER)
    for peak in [server, *peaks]:
        print(peak.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
