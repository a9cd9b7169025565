"""What the side-by-side benchmarks share: the metric names they report and the machine record in their JSON.
(A module of its own so that importing it has no side effects: engine_vs_vllm.py sets vLLM's environment.)"""
from __future__ import annotations

import os
import platform
from pathlib import Path

KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "median_itl_ms", "median_e2el_ms", "duration")


def machine() -> dict:
    info = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_avg_1m_start": os.getloadavg()[0]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:  # the vector width PyTorch's kernels run (AVX2, AVX512): kernel choices and speeds depend on it
        import torch

        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    return info
