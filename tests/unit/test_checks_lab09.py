"""Lab 09's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab09


def good_kv(w, kv, mem, n, u):
    return max(0, int((n * mem * u - w) // kv))


def test_kv_checker_accepts_correct(capsys):
    lab09.check_kv_capacity(good_kv, seed=0)
    lab09.check_kv_capacity(good_kv)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda w, kv, mem, n, u: max(0, int((n * (mem * u - w)) // kv)), "weights on every GPU"),
    (lambda w, kv, mem, n, u: max(0, int((mem * u - w) // kv)), "multiply the per-GPU memory"),
    (lambda w, kv, mem, n, u: max(0, int((n * mem - w) // kv)), "gpu_memory_utilization"),
    (lambda w, kv, mem, n, u: int((n * mem * u - w) // kv), "return 0"),
    (lambda w, kv, mem, n, u: str(good_kv(w, kv, mem, n, u)), "return an int"),
])
def test_kv_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_kv_capacity(bad, seed=1)


def test_kv_checker_lets_not_implemented_through():
    def todo(*a):
        raise NotImplementedError("hint")
    with pytest.raises(NotImplementedError):
        lab09.check_kv_capacity(todo)


def good_ar(b, n, bw):
    return 2 * (n - 1) / n * b / bw


def test_allreduce_checker_accepts_correct(capsys):
    lab09.check_allreduce_time(good_ar, seed=0)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda b, n, bw: (n - 1) / n * b / bw, "twice"),
    (lambda b, n, bw: 2 * b / bw, r"\(n-1\)/n"),
    (lambda b, n, bw: 2 * (n - 1) * b / bw, "1/n of the data"),
    (lambda b, n, bw: 2 * (n - 1) / n * b / bw + 1e-3, "expected"),
])
def test_allreduce_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_allreduce_time(bad, seed=2)


# --- the tensor-parallel parts: the learner's shard functions --------------------------------------------------
def _rng(n, world, rank):
    sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


def _shard(w, rank, world, g, D, split=_rng, q_group=True, o_rows=False, gate_cols=False):
    kv0, kv1 = split(w["k_proj"].shape[0] // D, world, rank)
    i0, i1 = split(w["gate_proj"].shape[0], world, rank)
    q0, q1 = (kv0 * g * D, kv1 * g * D) if q_group else (kv0 * D, kv1 * D)
    return {"q_proj": w["q_proj"][q0:q1], "k_proj": w["k_proj"][kv0 * D:kv1 * D], "v_proj": w["v_proj"][kv0 * D:kv1 * D],
            "o_proj": w["o_proj"][q0:q1] if o_rows else w["o_proj"][:, q0:q1],
            "gate_proj": w["gate_proj"][:, i0:i1] if gate_cols else w["gate_proj"][i0:i1],
            "up_proj": w["up_proj"][i0:i1], "down_proj": w["down_proj"][:, i0:i1]}


def _even(n, world, rank):
    return rank * (n // world), (rank + 1) * (n // world)


def _last_takes_more(n, world, rank):
    sizes = [n // world + (1 if r >= world - n % world else 0) for r in range(world)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    from lab_utils.course import learner_parts

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    yield tmp_path / "my_engine"
    learner_parts.forget()


def test_shard_checker_accepts_correct_and_submits(learner_dir, capsys):
    def shard_weights(w, rank, world_size, heads_per_kv, head_dim):
        return _shard(w, rank, world_size, heads_per_kv, head_dim)

    lab09.check_shard_weights(shard_weights, cases=20)
    assert "✔" in capsys.readouterr().out
    assert "def shard_weights(" in (learner_dir / "tensor_parallel.py").read_text()


@pytest.mark.parametrize("kw, msg", [
    (dict(split=_even), "first ranks take one more"),                 # 3 KV heads over 2 ranks -> 1 + 1
    (dict(split=_last_takes_more), "rank order, rank 0 first|first ranks take one more"),
    (dict(q_group=False), "query heads"),                               # q sliced like k
    (dict(o_rows=True), "row-parallel: keep whole columns"),            # o_proj by rows
    (dict(gate_cols=True), "column-parallel: keep whole rows"),         # gate_proj by columns
])
def test_shard_checker_rejects_mistakes(kw, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_shard_weights(lambda w, r, n, g, D: _shard(w, r, n, g, D, **kw), cases=20)


def test_row_checker_accepts_correct(learner_dir, capsys):
    lab09.check_row_parallel(lambda x, w, ar: ar(x @ w.T), cases=10)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda x, w, ar: x @ w.T, "sum the ranks' partial products"),               # no all-reduce
    (lambda x, w, ar: ar(x) @ w.T, "not the input"),                               # all-reduce of the input
    (lambda x, w, ar: (ar(x @ w.T), x @ w.T)[1], "partial product"),               # the sum thrown away
])
def test_row_checker_rejects_mistakes(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_row_parallel(bad, cases=10)


def test_tp_run_check_names_the_first_wrong_token_and_a_rank_on_the_reference():
    from types import SimpleNamespace

    parts = ["tensor_parallel.shard_weights", "tensor_parallel.row_parallel"]
    single = SimpleNamespace(token_ids=[[1, 2, 3], [4, 5, 6]], world_size=1, learner_parts=[[]])
    good = SimpleNamespace(token_ids=[[1, 2, 3], [4, 5, 6]], world_size=2, learner_parts=[parts, parts])
    lab09.check_tp_run(good, single, parts)
    with pytest.raises(AssertionError, match="prompt 1: the tensor-parallel run's greedy token 2 is 9"):
        lab09.check_tp_run(SimpleNamespace(**{**vars(good), "token_ids": [[1, 2, 3], [4, 5, 9]]}), single, parts)
    with pytest.raises(AssertionError, match="rank 1 .* did not run your"):
        lab09.check_tp_run(SimpleNamespace(**{**vars(good), "learner_parts": [parts, []]}), single, parts)


def _twin_token_model():
    """tiny-random (float32) with token 7's output row a copy of the greedy first token's: an exact tie there."""
    import torch

    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    model = build_random(REGISTRY["tiny-random"].config, seed=0).eval()
    prompt = [5, 17, 99, 40]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
        y = int(logits.argmax())
        model.lm_head.weight[7] = model.lm_head.weight[y]
    return model, prompt, y, int(logits.argmin())


def test_tp_run_check_accepts_a_difference_only_at_a_near_tie_of_the_unsharded_model(capsys):
    """The sharded sums run in another order: a flip at a near-tie passes (and is said), a flip at a clear margin
    fails, and without a model to judge it any difference fails."""
    from types import SimpleNamespace

    parts = ["tensor_parallel.shard_weights", "tensor_parallel.row_parallel"]
    model, prompt, y, worst = _twin_token_model()
    single = SimpleNamespace(token_ids=[[1, 2, 3], [y, 4, 5]], world_size=1, learner_parts=[[]])
    tied = SimpleNamespace(token_ids=[[1, 2, 3], [7, 8, 9]], world_size=2, learner_parts=[parts, parts])
    ties = lab09.check_tp_run(tied, single, parts, model=model, prompts=[[1], prompt])
    assert [(i, k) for i, k, _, _ in ties] == [(1, 0)] and ties[0][2] <= ties[0][3]
    out = capsys.readouterr().out
    assert "equal one process's on 1/2 prompts" in out and "prompt 1 token 0: gap 0 <=" in out
    clear = SimpleNamespace(**{**vars(tied), "token_ids": [[1, 2, 3], [worst, 8, 9]]})  # negative control
    with pytest.raises(AssertionError, match="prompt 1: .* token 0 .*near-tie tolerance"):
        lab09.check_tp_run(clear, single, parts, model=model, prompts=[[1], prompt])
    with pytest.raises(AssertionError, match="pass model= and prompts="):
        lab09.check_tp_run(tied, single, parts)
    with pytest.raises(AssertionError, match="another length"):
        lab09.check_tp_run(SimpleNamespace(**{**vars(tied), "token_ids": [[1, 2, 3], [y, 4]]}), single, parts,
                           model=model, prompts=[[1], prompt])


# --- every tensor-parallel rejection names the part, its file and a cause -----------------------------------------
def _strided_heads(w, rank, world, g, D):
    """Rank r takes KV heads r, r + world, ... (strided), each with its query heads: right sizes, wrong heads."""
    out = _shard(w, rank, world, g, D)
    kv = w["k_proj"].shape[0] // D
    heads = list(range(rank, kv, world))
    if len(heads) * D != out["k_proj"].shape[0]:
        return out
    rows = [h * D + d for h in heads for d in range(D)]
    return {**out, "k_proj": w["k_proj"][rows], "v_proj": w["v_proj"][rows]}


def _scaled(w, rank, world, g, D):
    return {k: v * 1.0001 if k == "up_proj" else v for k, v in _shard(w, rank, world, g, D).items()}


def _all_units_everywhere(w, rank, world, g, D):
    return {**_shard(w, rank, world, g, D), "up_proj": w["up_proj"]}


@pytest.mark.parametrize("bad, msg", [
    (_strided_heads, "not one consecutive slice|rank order"),
    (_scaled, "not one consecutive slice"),
    (_all_units_everywhere, r"should hold \d+ rows of up_proj"),
    (lambda w, r, n, g, D: _shard(w, r, n, g, D, o_rows=True), "row-parallel: keep whole columns"),
])
def test_shard_rejections_name_the_part_its_file_and_a_cause(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg) as err:
        lab09.check_shard_weights(bad, cases=20)
    text = str(err.value)
    assert text.startswith("tensor_parallel.shard_weights (lab 09, my_engine/tensor_parallel.py): ")
    assert "hint: " in text


@pytest.mark.parametrize("bad, msg", [
    (lambda x, w, ar: ar(x @ w.T) / 2, r"the sum times 0\.5"),                  # averaged over 2 "ranks"
    (lambda x, w, ar: ar(x @ w.T) + 1.0, "not the sum it returned"),
    (lambda x, w, ar: ar(x @ w.T).T, r"\[tokens, out_features\]"),
    (lambda x, w, ar: x @ w.T, "sum the ranks' partial products"),
])
def test_row_rejections_name_the_part_its_file_and_a_cause(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg) as err:
        lab09.check_row_parallel(bad, cases=10)
    text = str(err.value)
    assert text.startswith("tensor_parallel.row_parallel (lab 09, my_engine/tensor_parallel.py): ")
    assert "hint: " in text


@pytest.mark.parametrize("bad", [lambda w, kv, mem, n, u: 1, lambda w, kv, mem, n, u: good_kv(w, kv, mem, n, u) * 2])
def test_kv_capacity_rejections_always_have_a_cause(bad):
    with pytest.raises(AssertionError, match="hint: "):
        lab09.check_kv_capacity(bad, seed=0)


@pytest.mark.parametrize("bad", [lambda b, n, bw: b / bw, lambda b, n, bw: good_ar(b, n, bw) * 3])
def test_allreduce_rejections_always_have_a_cause(bad):
    with pytest.raises(AssertionError, match="hint: "):
        lab09.check_allreduce_time(bad, seed=0)
