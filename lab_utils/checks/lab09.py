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


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 09's claims from the run's measurements `r` (built in the notebook's claims cell).

    Only the first is a measurement of something that could go either way (two real processes). The byte counts
    compare the collectives' payloads with the cost model's formula, and the simulator's figures are deterministic
    functions of the cost model: they are labelled checks of the model, which fail when the model or the sharding
    changes, not when the hardware does."""
    from lab_utils.checks.claims import need

    need(r, "same_tp", "same_pp", "n_prompts", "max_tokens", "ratio_tp", "ratio_pp", "tp_dec", "pp_dec", "sat",
         "l4", "h100")
    tp, pp, sat, l4, hh = r["tp_dec"], r["pp_dec"], r["sat"], r["l4"], r["h100"]
    l4_gain, hh_gain = l4["thr2"] / l4["thr1"], hh["thr2"] / hh["thr1"]
    return [
        (f"measured: TP=2 and PP=2 over 2 real processes give the same greedy tokens as one ({r['n_prompts']} "
         f"prompts x {r['max_tokens']})", bool(r["same_tp"]) and bool(r["same_pp"])),
        (f"check of the model: the payloads TP and PP passed to their collectives match the cost model's formula "
         f"(TP {r['ratio_tp']:.3f}x, PP {r['ratio_pp']:.3f}x)", abs(r["ratio_tp"] - 1) < 0.01 and 1 <= r["ratio_pp"] < 1.05),
        (f"check of the model (simulated): 70B decode step TP {tp[2]:.1f} -> {tp[4]:.1f} -> {tp[8]:.1f} ms from 2 to 8 "
         f"GPUs, and PP never faster than TP", tp[8] < tp[4] < tp[2] and all(pp[n] > tp[n] for n in (2, 4, 8))),
        (f"check of the model (simulated): at saturation per-GPU throughput falls with the TP degree; 8 replicas "
         f"serve {sat[1] / sat[8]:.2f}x one TP=8 instance", sat[1] > sat[2] > sat[8]),
        (f"check of the model (simulated): a second GPU more than doubles KV space (weights paid once): L4 "
         f"{l4['tokens2'] / l4['tokens1']:.1f}x, H100 {hh['tokens2'] / hh['tokens1']:.2f}x",
         l4["tokens2"] > 2 * l4["tokens1"] and hh["tokens2"] > 2 * hh["tokens1"] and l4["seqs2"] > 2 * l4["seqs1"]),
        (f"check of the model (simulated, same workload on both GPUs): where the weights fill the GPU (8B on an L4) "
         f"TP=2 gives {l4_gain:.2f}x one GPU's throughput (two replicas: 2x), more than on an H100 ({hh_gain:.2f}x)",
         l4_gain > 2 and l4_gain > hh_gain),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 09's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)
