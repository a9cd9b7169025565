"""Checks for lab 09's exercises: the KV-capacity formula and the ring all-reduce time.

Each check runs the learner's function on fresh random inputs, compares with `lab_utils.sim.cost_model`, and on a
mismatch raises AssertionError naming the input, the expected and returned values and (when recognisable) the
mistake. It never shows the reference code.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from lab_utils.sim.cost_model import allreduce_time

GB = 1e9


def _ref_tokens(weight_bytes, kv_bytes_per_token, mem_bytes, num_gpus, util) -> int:
    free = num_gpus * mem_bytes * util - weight_bytes
    return max(0, int(free // kv_bytes_per_token))


def _kv_cases(rng: random.Random) -> list[tuple]:
    cases = [(16.06 * GB, 131072, 80 * GB, 1, 0.9), (16.06 * GB, 131072, 80 * GB, 2, 0.9),
             (141.1 * GB, 327680, 80 * GB, 1, 0.9),  # 70B on one H100: does not fit -> 0
             (141.1 * GB, 327680, 80 * GB, 4, 0.95), (0.54 * GB, 46080, 24 * GB, 1, 0.5)]
    for _ in range(30):
        cases.append((rng.uniform(0.2, 150) * GB, rng.choice([16384, 32768, 46080, 131072, 327680]),
                      rng.choice([24, 40, 80, 141]) * GB, rng.choice([1, 2, 4, 8]), rng.choice([0.8, 0.9, 0.95])))
    return cases


def check_kv_capacity(fn: Callable[..., int], seed: int | None = None) -> None:
    """`fn(weight_bytes, kv_bytes_per_token, mem_bytes_per_gpu, num_gpus, gpu_memory_utilization) -> int`:
    KV tokens that fit when the model is sharded over `num_gpus` (0 if the weights do not fit)."""
    rng = random.Random(seed)
    for w, kv, mem, n, u in _kv_cases(rng):
        exp = _ref_tokens(w, kv, mem, n, u)
        got = fn(w, kv, mem, n, u)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got - exp) <= 1:
            continue
        args = f"kv_capacity(weight_bytes={w:.3g}, kv_bytes_per_token={kv}, mem_bytes_per_gpu={mem:.3g}, num_gpus={n}, util={u})"
        hint = ""
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            if exp == 0 and got < 0:
                hint = "the weights do not fit, so no KV fits: return 0, not a negative number"
            elif abs(got - max(0, int((n * (mem * u - w)) // kv))) <= 1 and n > 1:
                hint = "you paid the weights on every GPU; sharded (tensor parallel), the weights are split, paid once in total"
            elif abs(got - max(0, int((mem * u - w) // kv))) <= 1 and n > 1:
                hint = "the memory of all `num_gpus` devices holds KV: multiply the per-GPU memory by num_gpus"
            elif abs(got - max(0, int((n * mem - w) // kv))) <= 1:
                hint = "only gpu_memory_utilization of each device is yours to use"
            elif abs(got - max(0, (n * mem * u - w) / kv)) < 1e-6 * exp + 1e-9 and got != int(got):
                hint = "return whole tokens (floor)"
        else:
            hint = f"return an int, not {type(got).__name__}"
        raise AssertionError(f"{args} returned {got!r}, expected {exp}" + (f"\n   hint: {hint}" if hint else ""))
    print("✔ check_kv_capacity: KV tokens match on", len(_kv_cases(random.Random(0))), "cases (incl. models that do not fit)")


def check_allreduce_time(fn: Callable[[float, int, float], float], seed: int | None = None) -> None:
    """`fn(num_bytes, n, link_bw) -> seconds` of a ring all-reduce over n devices (no latency term)."""
    rng = random.Random(seed)
    cases = [(8e6, 8, 450e9), (4096.0, 4, 32e9), (1e6, 2, 1e9), (1e6, 1, 1e9)]
    cases += [(rng.uniform(1e3, 1e9), rng.choice([2, 3, 4, 6, 8, 16]), rng.choice([32e9, 300e9, 450e9])) for _ in range(30)]
    for b, n, bw in cases:
        exp = allreduce_time(b, n, bw)
        got = fn(b, n, bw)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, exp, rel_tol=1e-6, abs_tol=1e-15):
            continue
        hint = ""
        if isinstance(got, (int, float)) and not isinstance(got, bool) and exp > 0:
            r = got / exp
            if math.isclose(r, 0.5, rel_tol=1e-6):
                hint = "a ring all-reduce is a reduce-scatter then an all-gather: the data crosses the ring twice"
            elif math.isclose(got, 2 * b / bw, rel_tol=1e-6):
                hint = "each device sends only (n-1)/n of the data per phase, not all of it"
            elif math.isclose(got, 2 * (n - 1) * b / bw, rel_tol=1e-6):
                hint = "each chunk is 1/n of the data: 2·(n-1)/n·bytes, not 2·(n-1)·bytes"
        elif n == 1 and got != 0:
            hint = "with one device there is nothing to reduce: 0 seconds"
        raise AssertionError(f"allreduce_time(num_bytes={b:.4g}, n={n}, link_bw={bw:.3g}) returned {got!r}, expected "
                             f"{exp:.6g}" + (f"\n   hint: {hint}" if hint else ""))
    print(f"✔ check_allreduce_time: ring all-reduce times match on {len(cases)} cases")
