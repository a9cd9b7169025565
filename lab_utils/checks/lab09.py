"""Checks for lab 09's exercises: the KV-capacity formula and the ring all-reduce time.

Each check runs the learner's function on fresh random inputs, compares with `lab_utils.sim.cost_model`, and on a
mismatch raises AssertionError naming the input, the expected and returned values and (when recognisable) the
mistake. It never shows the reference code.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from lab_utils.checks.claims import Claim
from lab_utils.checks.part_named import checks_part
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
        hint = hint or ("the KV room is what gpu_memory_utilization of all num_gpus devices leaves after the "
                        "weights (sharded: paid once in total), in whole tokens of kv_bytes_per_token; 0 when the "
                        "weights do not fit")
        raise AssertionError(f"{args} returned {got!r}, expected {exp}\n   hint: {hint}")
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
        hint = hint or ("a ring all-reduce sends 2·(n-1)/n of num_bytes over each device's link (reduce-scatter, "
                        "then all-gather), at link_bw bytes per second, no latency term")
        raise AssertionError(f"allreduce_time(num_bytes={b:.4g}, n={n}, link_bw={bw:.3g}) returned {got!r}, expected "
                             f"{exp:.6g}\n   hint: {hint}")
    print(f"✔ check_allreduce_time: ring all-reduce times match on {len(cases)} cases")


# --- tensor parallelism: the learner's shard functions ------------------------------------------------------

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # keep rows of the weight (output features)


def _tp_case(rng: random.Random) -> dict:
    import torch

    world = rng.choice([1, 2, 2, 3, 4])
    kv, group, D = rng.randint(world, world + 3), rng.choice([1, 2, 3]), rng.choice([2, 4])
    hidden, inter = rng.choice([6, 8, 12]), rng.randint(world, 4 * world + 3)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    shapes = {"q_proj": (kv * group * D, hidden), "k_proj": (kv * D, hidden), "v_proj": (kv * D, hidden),
              "o_proj": (hidden, kv * group * D), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    return dict(w={k: torch.randn(v, generator=g) for k, v in shapes.items()}, world=world, group=group, D=D, kv=kv,
                inter=inter)


def _where(full, got, dim: int) -> str:
    """Which slice of `full` along `dim` the learner's tensor is, in words ('rows 4:8'), or ''."""
    n = got.shape[dim] if got.dim() == full.dim() else -1
    if n < 0 or any(got.shape[d] != full.shape[d] for d in range(full.dim()) if d != dim):
        return ""
    for off in range(full.shape[dim] - n + 1):
        if full.narrow(dim, off, n).equal(got):
            return f"{'rows' if dim == 0 else 'columns'} {off}:{off + n}"
    return ""


def _shard_hint(name, got, want, full, c, rank) -> str:
    from lab_utils.parallel.tensor_parallel import split_sizes

    world, D, group, kv = c["world"], c["D"], c["group"], c["kv"]
    dim = 0 if name in _COLUMN else 1
    if got.dim() == 2 and got.shape[1 - dim] != full.shape[1 - dim]:
        kind = "column-parallel: keep whole rows (output features), w[a:b]" if dim == 0 else \
            "row-parallel: keep whole columns (input features), w[:, a:b]"
        return f"{name} is {kind}; you cut the other dimension"
    if kv % world and got.shape[dim] in (kv // world * D, kv // world * group * D) and name != "gate_proj":
        return (f"{kv} KV heads over {world} ranks do not divide evenly: the first ranks take one more "
                f"({split_sizes(kv, world)}); every head must be on exactly one rank")
    if name in ("q_proj", "o_proj") and group > 1 and got.shape[dim] * group == want.shape[dim]:
        return (f"each KV head serves {group} query heads: this rank's query heads are its KV heads times "
                f"heads_per_kv, so q_proj/o_proj keep heads_per_kv * head_dim features per KV head")
    if name in ("gate_proj", "up_proj", "down_proj") and c["inter"] % world and got.shape[dim] == c["inter"] // world:
        return (f"{c['inter']} intermediate units over {world} ranks: the first ranks take one more "
                f"({split_sizes(c['inter'], world)}), none is dropped")
    where, should = _where(full, got, dim), _where(full, want, dim)
    if where and should and got.shape == want.shape:
        return (f"rank {rank} holds {where} but should hold {should}: ranks take consecutive slices in rank order, "
                f"rank 0 first (KV head h goes with query heads h*heads_per_kv .. (h+1)*heads_per_kv - 1)")
    side = "rows" if dim == 0 else "columns"
    if got.dim() == 2 and got.shape == want.shape and not where:
        return (f"your {name} has the right shape but is not one consecutive slice of the full weight's {side} "
                f"(rank {rank} should hold {should}): a rank keeps whole heads / units in one block, the weights as "
                f"they are (not transposed, reordered or scaled)")
    if got.dim() == 2 and got.shape[dim] != want.shape[dim]:
        return (f"rank {rank} of {world} should hold {want.shape[dim]} {side} of {name} ({should}), you kept "
                f"{got.shape[dim]}: split the heads (and intermediate units) over the ranks, each rank the "
                f"consecutive share split_sizes gives it")
    return f"{name} must stay a 2-D weight [out, in], got shape {tuple(got.shape)}"


@checks_part("tensor_parallel.shard_weights")
def check_shard_weights(fn: Callable, seed: int | None = 0, cases: int = 60) -> None:
    """`fn(w, rank, world_size, heads_per_kv, head_dim) -> dict` against the reference on random layer shapes
    (uneven head and unit counts included) for every rank; then the whole tiny model, sharded by `fn` over 2
    simulated ranks, must compute the same logits as the unsharded one. Submits `fn` when it passes."""
    from lab_utils.course import learner_parts
    from lab_utils.parallel.tensor_parallel import LINEARS, shard_weights

    rng = random.Random(seed)
    for trial in range(cases):
        c = _tp_case(rng)
        for rank in range(c["world"]):
            want = shard_weights(dict(c["w"]), rank, c["world"], c["group"], c["D"])
            got = fn({k: v.clone() for k, v in c["w"].items()}, rank, c["world"], c["group"], c["D"])
            where = (f"case {trial}: rank {rank} of {c['world']}, {c['kv']} KV heads x {c['group']} query heads each, "
                     f"head_dim {c['D']}, {c['inter']} intermediate units")
            if not isinstance(got, dict):
                raise AssertionError(f"{where}: return a dict of the seven weights, got {type(got).__name__}")
            missing = [k for k in LINEARS if k not in got]
            if missing:
                raise AssertionError(f"{where}: the returned dict has no {missing}: return all seven weights")
            for name in LINEARS:
                g = got[name]
                if hasattr(g, "shape") and tuple(g.shape) == tuple(want[name].shape) and g.equal(want[name]):
                    continue
                shape = tuple(g.shape) if hasattr(g, "shape") else type(g).__name__
                hint = _shard_hint(name, g, want[name], c["w"][name], c, rank) if hasattr(g, "shape") else ""
                raise AssertionError(f"{where}: {name} is {shape}, expected {tuple(want[name].shape)}"
                                     + ("" if shape != tuple(want[name].shape) else " (same shape, other values)")
                                     + (f"\n   hint: {hint}" if hint else ""))
    _tp_forward(fn, None)
    print(f"✔ check_shard_weights: every rank's slices match on {cases} random layers (uneven splits included); "
          f"a tiny Llama sharded by your function over 2 ranks computes the unsharded logits")
    learner_parts.submit("tensor_parallel.shard_weights", fn)


def _row_hint(x, w, got, partial, full, calls) -> str:
    import torch

    if not calls:
        return "sum the ranks' partial products: pass this rank's product to all_reduce and return its result"
    if calls[0] != tuple(partial.shape):
        return (f"all_reduce received a tensor of shape {calls[0]}: all-reduce the product x @ weight.T "
                f"({tuple(partial.shape)}), not the input")
    if len(calls) > 1:
        return f"one all-reduce per linear: you called it {len(calls)} times"
    if isinstance(got, torch.Tensor) and got.shape == partial.shape and torch.allclose(got, partial, atol=1e-5):
        return "you returned this rank's partial product: return what all_reduce gives back (the sum)"
    if not isinstance(got, torch.Tensor):
        return f"return a tensor (the all-reduced product), got {type(got).__name__}"
    if got.shape != full.shape:
        return (f"the output is [tokens, out_features] = {tuple(full.shape)}: x @ weight.T, all-reduced; got "
                f"{tuple(got.shape)}")
    ratio = (got.double().sum() / full.double().sum()).item() if full.double().sum().abs() > 1e-6 else None
    if ratio is not None and ratio > 0 and torch.allclose(got, full * ratio, rtol=1e-4, atol=1e-4) and \
            abs(ratio - 1) > 1e-3:
        return (f"your output is the sum times {ratio:.3g}: the all-reduce already sums the ranks' products; "
                f"do not average or scale it")
    return ("all_reduce was called once with the right shape, but the output is not the sum it returned: return "
            "all_reduce(x @ weight.T) unchanged (a bias or any other term is added once, after it)")


@checks_part("tensor_parallel.row_parallel")
def check_row_parallel(fn: Callable, seed: int | None = 0, cases: int = 40) -> None:
    """`fn(x, weight, all_reduce) -> y` on random shapes and rank counts, with an all-reduce that adds the other
    (simulated) ranks' partial products; y must be the full x W^T. Submits `fn` when it passes."""
    import torch

    from lab_utils.course import learner_parts
    from lab_utils.parallel.tensor_parallel import shard_range

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for trial in range(cases):
        world, T, d_in, d_out = rng.choice([1, 2, 3, 4]), rng.randint(1, 5), rng.randint(4, 12), rng.randint(2, 9)
        rank = rng.randrange(world)
        x_full, w_full = torch.randn(T, d_in, generator=g), torch.randn(d_out, d_in, generator=g)
        sl = [slice(*shard_range(d_in, world, r)) for r in range(world)]
        parts = [x_full[:, s] @ w_full[:, s].T for s in sl]
        calls = []

        def all_reduce(t, _rank=rank, _parts=parts, _calls=calls):
            _calls.append(tuple(t.shape))
            if tuple(t.shape) == tuple(_parts[0].shape):
                t += sum(p for r, p in enumerate(_parts) if r != _rank)
            return t

        x, w = x_full[:, sl[rank]].clone(), w_full[:, sl[rank]].clone()
        got = fn(x, w, all_reduce)
        want = x_full @ w_full.T
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-4) \
                and len(calls) == 1:
            continue
        hint = "" if world > 1 or calls else "call all_reduce even on one rank (it returns its argument there)"
        hint = hint or _row_hint(x, w, got, parts[rank], want, calls)
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"case {trial}: rank {rank} of {world}, x {tuple(x.shape)}, weight {tuple(w.shape)}: "
                             f"returned {shape}, expected the full product {tuple(want.shape)}"
                             + (f"\n   hint: {hint}" if hint else ""))
    _tp_forward(None, fn)
    print(f"✔ check_row_parallel: the all-reduced partial products equal x W^T on {cases} random cases; a tiny "
          f"Llama over 2 ranks with your row-parallel linears computes the unsharded logits")
    learner_parts.submit("tensor_parallel.row_parallel", fn)


class _ThreadComm:
    """The ranks of one process as threads: all_reduce sums the ranks' tensors (in rank order) at a barrier."""

    def __init__(self, rank: int, shared: dict) -> None:
        import torch

        self.rank, self.world_size, self.device, self.shared = rank, shared["world"], torch.device("cpu"), shared

    def all_reduce(self, t):
        s = self.shared
        s["slots"][self.rank] = t.clone()
        s["barrier"].wait()
        total = s["slots"][0].clone()
        for other in s["slots"][1:]:
            total += other
        s["barrier"].wait()
        t.copy_(total)
        return t


def _tp_forward(shard_fn, row_fn, world: int = 2) -> None:
    """A tiny Llama (3 KV heads: an uneven split) sharded over `world` thread-ranks computes the full logits."""
    import copy as copy_mod
    import threading

    import torch

    from lab_utils.course.parts import EngineParts
    from lab_utils.models.kv_cache_simple import SimpleKVCache
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY
    from lab_utils.parallel.tensor_parallel import (
        row_parallel,
        shard_llama,
        shard_weights,
    )

    cfg = dict(REGISTRY["tiny-random"].config, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
               hidden_size=48, intermediate_size=101, vocab_size=512)
    full = build_random(cfg, seed=1).eval()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    parts = EngineParts({k: f for k, f in (("tensor_parallel.shard_weights", shard_fn),
                                           ("tensor_parallel.row_parallel", row_fn)) if f is not None})
    shard_fn = parts.function("tensor_parallel.shard_weights", shard_weights)
    row_fn = parts.function("tensor_parallel.row_parallel", row_parallel)

    def logits(model, kv_heads):
        c = model.config
        cache = SimpleKVCache(c.num_hidden_layers, 1, ids.shape[1], kv_heads, c.head_dim, model.dtype, torch.device("cpu"))
        with torch.inference_mode():
            return model.logits(model.hidden_states(ids, cache.positions(ids.shape[1]), attention=cache))

    want = logits(full, cfg["num_key_value_heads"])
    shared = {"world": world, "slots": [None] * world, "barrier": threading.Barrier(world, timeout=60)}
    got, errors = [None] * world, [None] * world

    def rank_main(r):
        try:
            m = shard_llama(copy_mod.deepcopy(full), _ThreadComm(r, shared), shard_fn, row_fn)
            got[r] = logits(m, m.local_kv_heads)
        except threading.BrokenBarrierError:
            errors[r] = AssertionError("the ranks called all_reduce a different number of times (one waited for "
                                       "the other in vain): every rank calls it once per row-parallel linear")
            shared["barrier"].abort()
        except BaseException as err:  # noqa: BLE001 - reported below, in the learner's terms
            errors[r] = err
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if err is not None:
        if isinstance(err, NotImplementedError):
            raise err
        raise AssertionError(f"the tiny model sharded over {world} ranks with your function stopped: "
                             f"{type(err).__name__}: {err}") from None
    for r in range(world):
        if not torch.allclose(got[r], want, atol=1e-4, rtol=1e-3):
            bad = (got[r] - want).abs().max().item()
            raise AssertionError(f"the tiny model sharded over {world} ranks: rank {r}'s logits differ from the "
                                 f"unsharded model's by up to {bad:.3g} (each rank must end with the full output)")


def check_tp_run(tp, single, parts=("tensor_parallel.shard_weights", "tensor_parallel.row_parallel"),
                 model=None, prompts=None) -> list[tuple[int, int, float, float]]:
    """The real 2-process tensor-parallel run (`run_parallel(mode="tp", learner_parts=...)`) against one process:
    every rank ran the learner's parts, and every prompt's greedy tokens are equal or part at a near-tie.

    The sharded row-parallel layers add their partial sums in another order than one process, so the two runs are
    not the same arithmetic: at a near-tie the argmax may flip and every later token follows. At the first
    difference the unsharded `model` (a loaded model, or its name: loaded in float32 on the CPU) scores the shared
    prefix (prompt + tokens before it, `prompts` as given to run_parallel); the difference is accepted only where
    the two candidate tokens' logits lie within `teacher_forced.rounding_tie` (float32) of each other, the one
    position both runs scored on the same prefix. Returns those near-ties as (prompt, token, gap, tolerance)."""
    for r, used in enumerate(tp.learner_parts or [[] for _ in range(tp.world_size)]):
        missing = [p for p in parts if p not in used]
        if missing:
            raise AssertionError(f"rank {r} of the tensor-parallel run did not run your {missing} (it ran the "
                                 f"reference): pass learner_parts={list(parts)} to run_parallel")
    if len(tp.token_ids) != len(single.token_ids):
        raise AssertionError(f"the tensor-parallel run returned {len(tp.token_ids)} prompts' tokens, one process "
                             f"{len(single.token_ids)}")
    ties: list[tuple[int, int, float, float]] = []
    for i, (a, b) in enumerate(zip(tp.token_ids, single.token_ids)):
        if a == b:
            continue
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        said = (f"prompt {i}: the tensor-parallel run's greedy token {k} is {a[k] if k < len(a) else None}, one "
                f"process gives {b[k] if k < len(b) else None} (tokens before it agree)")
        if k >= min(len(a), len(b)):
            raise AssertionError(f"{said}: the sharded run stopped at another length")
        if model is None or prompts is None:
            raise AssertionError(f"{said}: pass model= and prompts= to judge whether it is a near-tie")
        gap, tol = _first_difference_gap(model, prompts, i, b[:k], a[k], b[k])
        if gap > tol:
            raise AssertionError(f"{said}; the unsharded model's logits for the two differ by {gap:.3g} > the "
                                 f"float32 near-tie tolerance {tol:.3g}: the sharded layers compute another function")
        ties.append((i, k, gap, tol))
    n, t = len(tp.token_ids), len(single.token_ids[0]) if single.token_ids else 0
    line = (f"✔ check_tp_run: {tp.world_size} processes ran your shard_weights and row_parallel; greedy tokens equal "
            f"one process's on {n - len(ties)}/{n} prompts x {t} tokens")
    if ties:
        line += ("; the others part at a near-tie of the unsharded model, where the sharded sums' other order may "
                 "flip the argmax (" + ", ".join(f"prompt {i} token {k}: gap {g:.2g} <= {tl:.2g}"
                                                 for i, k, g, tl in ties) + ")")
    print(line)
    return ties


def _first_difference_gap(model, prompts, i: int, before: list[int], x: int, y: int) -> tuple[float, float]:
    """|logit(x) - logit(y)| of the unsharded model after prompt i + `before`, and the float32 near-tie tolerance."""
    import torch

    from lab_utils.checks.teacher_forced import rounding_tie, score
    from lab_utils.parallel.launch import _tokenize

    if isinstance(model, str):
        from lab_utils.models.loader import load_model

        prompt = _tokenize(model, [prompts[i]])[0]
        model = load_model(model, device="cpu", dtype=torch.float32)[0]
    elif isinstance(prompts[i], str):
        raise ValueError("with a loaded model, pass the prompts as token ids (or pass the model's name)")
    else:
        prompt = [int(t) for t in prompts[i]]
    logits = score(model, prompt + list(before))[-1]
    return abs(float(logits[x] - logits[y])), rounding_tie(torch.float32, logits)


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 09's claims from the run's measurements `r` (built in the notebook's claims cell).

    Only the first is a measurement of something that could go either way (two real processes). The byte counts
    compare the collectives' payloads with the cost model's formula, and the simulator's figures are deterministic
    functions of the cost model: they are labelled checks of the model, which fail when the model or the sharding
    changes, not when the hardware does."""
    from lab_utils.checks.claims import need

    need(r, "same_tp", "same_pp", "tp_parts", "n_prompts", "max_tokens", "ratio_tp", "ratio_pp", "tp_dec", "pp_dec", "sat",
         "l4", "h100")
    tp, pp, sat, l4, hh = r["tp_dec"], r["pp_dec"], r["sat"], r["l4"], r["h100"]
    l4_gain, hh_gain = l4["thr2"] / l4["thr1"], hh["thr2"] / hh["thr1"]
    yours = ("tensor_parallel.shard_weights", "tensor_parallel.row_parallel")
    ran = [all(p in used for p in yours) for used in r["tp_parts"]]
    return [
        (f"measured: each of the {len(ran)} TP ranks sharded the model with your shard_weights and row_parallel",
         len(ran) >= 2 and all(ran)),
        (f"measured: TP=2 and PP=2 over 2 real processes give the same greedy tokens as one ({r['n_prompts']} "
         f"prompts x {r['max_tokens']}; TP's other summation order may flip a near-tie, and "
         f"{r.get('tp_ties', 0)} prompts parted at one)", bool(r["same_tp"]) and bool(r["same_pp"])),
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


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
