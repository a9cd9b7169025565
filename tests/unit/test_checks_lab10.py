"""Lab 10's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import math

import pytest

from lab_utils.checks import lab10


def good_roof(f, b, p, bw, oh):
    return max(f / p, b / bw) + oh


def test_roofline_checker_accepts_correct(capsys):
    lab10.check_roofline_time(good_roof, seed=0)
    lab10.check_roofline_time(good_roof)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda f, b, p, bw, oh: f / p + b / bw + oh, "not their sum"),
    (lambda f, b, p, bw, oh: max(f / p, b / bw), "overhead"),
    (lambda f, b, p, bw, oh: min(f / p, b / bw) + oh, "max, not min"),
])
def test_roofline_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_roofline_time(bad, seed=1)


def good_goodput(ttfts, tpots, dur, slo_t, slo_p):
    ok = sum(t * 1e3 <= slo_t and (math.isnan(p) or p * 1e3 <= slo_p) for t, p in zip(ttfts, tpots))
    return ok / dur


def test_goodput_checker_accepts_correct(capsys):
    lab10.check_goodput(good_goodput, seed=0)
    lab10.check_goodput(good_goodput)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda tt, tp, d, a, b: good_goodput(tt, tp, d, a, b) * d, "divide the number of good requests"),
    (lambda tt, tp, d, a, b: good_goodput(tt, tp, d, a, b) * d / len(tt), "attainment"),
    (lambda tt, tp, d, a, b: sum((t * 1e3 <= a) or (not math.isnan(p) and p * 1e3 <= b) for t, p in zip(tt, tp)) / d,
     "both"),
    (lambda tt, tp, d, a, b: sum(t * 1e3 <= a and not math.isnan(p) and p * 1e3 <= b for t, p in zip(tt, tp)) / d,
     "NaN"),
])
def test_goodput_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_goodput(bad, seed=3)


def test_goodput_checker_lets_not_implemented_through():
    def todo(*a):
        raise NotImplementedError("hint")
    with pytest.raises(NotImplementedError):
        lab10.check_goodput(todo)


# --- the KV hand-off parts --------------------------------------------------------------------------------------
import torch

from lab_utils.disagg.workers import export_kv, import_kv, resume_prefilled
from lab_utils.engine.request import Status


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    from lab_utils.course import learner_parts

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    yield tmp_path / "my_engine"
    learner_parts.forget()


def _slots(bt, n, bs):
    return torch.tensor([bt[t // bs] * bs + t % bs for t in range(n)])


def test_handoff_checkers_accept_the_reference_and_submit(learner_dir, capsys):
    lab10.check_export_kv(export_kv, cases=20)
    lab10.check_import_kv(import_kv, cases=20)
    lab10.check_resume_prefilled(resume_prefilled)
    lab10.check_handoff_in_engine(export_kv, import_kv, resume_prefilled, num_requests=4)
    assert capsys.readouterr().out.count("✔") == 4
    assert "def export_kv(" in (learner_dir / "disagg.py").read_text()


def _contiguous(cache, bt, n, bs):
    return {k: t[:, :n].clone() for k, t in cache.items()}


def _whole_blocks(cache, bt, n, bs):
    s = torch.tensor([b * bs + o for b in bt for o in range(bs)])
    return {k: t[:, s] for k, t in cache.items()}


def _no_scales(cache, bt, n, bs):
    return {k: t[:, _slots(bt, n, bs)] for k, t in cache.items() if k in ("k", "v")}


def _tokens_first(cache, bt, n, bs):
    return {k: t[:, _slots(bt, n, bs)].transpose(0, 1).contiguous() for k, t in cache.items()}


@pytest.mark.parametrize("bad, msg", [
    (_contiguous, "blocks are scattered"),
    (_whole_blocks, "not every slot of its"),
    (_no_scales, "an int8 cache keeps a scale"),
    (_tokens_first, "layers first"),
])
def test_export_checker_rejects_mistakes(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_export_kv(bad, cases=30)


def _import_contiguous(cache, bt, kv, bs):
    for k, t in kv.items():
        cache[k][:, :t.shape[1]] = t


def _import_kv_only(cache, bt, kv, bs):
    for k in ("k", "v"):
        cache[k][:, _slots(bt, kv[k].shape[1], bs)] = kv[k]


def _import_new_tensors(cache, bt, kv, bs):
    for k, t in kv.items():
        c = cache[k].clone()
        c[:, _slots(bt, t.shape[1], bs)] = t
        cache[k] = c


@pytest.mark.parametrize("bad, msg", [
    (_import_contiguous, "not slot t"),
    (_import_kv_only, "scales too"),
    (_import_new_tensors, "in place"),
])
def test_import_checker_rejects_mistakes(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_import_kv(bad, cases=30)


def _no_first_token(req, first, kv):
    req.num_computed_tokens = req.num_prompt_tokens
    req.status, req.swapped_kv = Status.SWAPPED, kv


def _first_token_computed(req, first, kv):
    resume_prefilled(req, first, kv)
    req.num_computed_tokens += 1


def _waiting(req, first, kv):
    resume_prefilled(req, first, kv)
    req.status = Status.WAITING


@pytest.mark.parametrize("bad, msg", [
    (_no_first_token, "append first_token"),
    (_first_token_computed, "first decode step computes it"),
    (_waiting, "recomputed"),
])
def test_resume_checker_rejects_mistakes(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_resume_prefilled(bad)


def _import_swapped_blocks(cache, bt, kv, bs):
    """The first two full blocks of the prompt swapped: attention sees the same (K, V) pairs, so the greedy
    tokens stay those of one engine; only the blocks themselves show it."""
    bt = list(bt)
    if kv["k"].shape[1] >= 2 * bs:
        bt[0], bt[1] = bt[1], bt[0]
    import_kv(cache, bt, kv, bs)


@pytest.mark.parametrize("kw, msg", [
    (dict(export_fn=_contiguous), "hold other KV than the prefill engine's"),  # another request's KV decoded
    (dict(export_fn=_no_scales), "every cache tensor"),              # the workers name the part
    (dict(import_fn=_import_contiguous), "hold other KV than the prefill engine's"),
    (dict(import_fn=_import_swapped_blocks), r"block\(s\) \[0, 1\] hold other KV"),  # same tokens, wrong blocks
    (dict(resume_fn=_first_token_computed), "your disagg.resume_prefilled left"),  # the engine names the part
])
def test_handoff_in_engine_rejects_mistakes(kw, msg):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_handoff_in_engine(**kw, num_requests=6)


def test_meta_checker_accepts_the_reference_and_names_mistakes(learner_dir):
    from lab_utils.disagg.workers import request_meta

    lab10.check_request_meta(request_meta)

    def first_prompt_token(req):
        return {**request_meta(req), "first_token": req.token_ids[0]}

    def no_timestamps(req):
        return {k: v for k, v in request_meta(req).items() if k != "first_token_time"}

    def default_params(req):
        from lab_utils.engine.sampling_params import SamplingParams

        return {**request_meta(req), "params": SamplingParams()}

    for bad, msg in ((first_prompt_token, "first \\*generated\\* token"), (no_timestamps, "TTFT happened"),
                     (default_params, "own SamplingParams")):
        with pytest.raises(AssertionError, match=msg):
            lab10.check_request_meta(bad)
    with pytest.raises(AssertionError, match="your disagg.request_meta sent no"):
        lab10.check_handoff_in_engine(meta_fn=no_timestamps, num_requests=3)


# --- every hand-off rejection names the part, its file and a cause ------------------------------------------------
def _export_block_order_reversed(cache, bt, n, bs):  # the blocks read last to first
    order = [bt[::-1][t // bs] * bs + t % bs for t in range(n)]
    return {k: t[:, order] for k, t in cache.items()}


def _export_offset_off_by_one(cache, bt, n, bs):  # each token read one slot late within its block
    s = torch.tensor([bt[t // bs] * bs + (t + 1) % bs for t in range(n)])
    return {k: t[:, s] for k, t in cache.items()}


def _export_halved(cache, bt, n, bs):  # converted, not copied
    return {k: t[:, _slots(bt, n, bs)] * 0.5 for k, t in cache.items()}


def _export_one_short(cache, bt, n, bs):
    return {k: t[:, _slots(bt, n, bs)[:-1]] for k, t in cache.items()}


@pytest.mark.parametrize("bad, msg", [
    (_export_block_order_reversed, r"K came from slot \d+; it lives in block"),
    (_export_offset_off_by_one, r"K came from slot \d+; it lives in block"),
    (_export_halved, "in no slot of the cache"),
    (_export_one_short, "one entry per token of the request"),
    (_contiguous, "blocks are scattered"),
])
def test_export_rejections_name_the_part_its_file_and_a_cause(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg) as err:
        lab10.check_export_kv(bad, cases=30)
    text = str(err.value)
    assert text.startswith("disagg.export_kv (lab 10, my_engine/disagg.py): ") and "hint: " in text


def _import_blocks_reversed(cache, bt, kv, bs):
    for k, t in kv.items():
        cache[k][:, _slots(bt[::-1], t.shape[1], bs)] = t


def _import_skips_last_token(cache, bt, kv, bs):
    for k, t in kv.items():
        cache[k][:, _slots(bt, t.shape[1] - 1, bs)] = t[:, :-1]


def _import_halved(cache, bt, kv, bs):
    for k, t in kv.items():
        cache[k][:, _slots(bt, t.shape[1], bs)] = t * 0.5


@pytest.mark.parametrize("bad, msg", [
    (_import_blocks_reversed, r"slot \d+ (holds token \d+'s KV|belongs to no token)"),
    (_import_skips_last_token, r"slot \d+ \(token \d+: block \d+, offset \d+\) was not written"),
    (_import_halved, "holds a value that is no received token's"),
    (_import_contiguous, "not slot t"),
])
def test_import_rejections_name_the_part_its_file_and_a_cause(bad, msg, learner_dir):
    with pytest.raises(AssertionError, match=msg) as err:
        lab10.check_import_kv(bad, cases=30)
    text = str(err.value)
    assert text.startswith("disagg.import_kv (lab 10, my_engine/disagg.py): ") and "hint: " in text


@pytest.mark.parametrize("bad", [_no_first_token, _waiting])
def test_resume_rejections_name_the_part_and_its_file(bad, learner_dir):
    with pytest.raises(AssertionError) as err:
        lab10.check_resume_prefilled(bad)
    assert str(err.value).startswith("disagg.resume_prefilled (lab 10, my_engine/disagg.py): ")
    assert "hint: " in str(err.value)


@pytest.mark.parametrize("field", ["first_token_time", "request_id"])
def test_meta_rejections_name_the_part_and_its_file(field, learner_dir):
    from lab_utils.disagg.workers import request_meta

    def wrong(req):
        meta = dict(request_meta(req))
        meta.pop(field)
        return meta

    with pytest.raises(AssertionError) as err:
        lab10.check_request_meta(wrong)
    assert str(err.value).startswith("disagg.request_meta (lab 10, my_engine/disagg.py): ")
    assert f"no {field!r}" in str(err.value) and "hint: " in str(err.value)


@pytest.mark.parametrize("bad", [lambda f, b, p, bw, oh: f / p * 2 + oh, lambda f, b, p, bw, oh: b / bw])
def test_roofline_rejections_always_have_a_cause(bad):
    with pytest.raises(AssertionError, match="hint: "):
        lab10.check_roofline_time(bad, seed=0)


@pytest.mark.parametrize("bad", [lambda *a: good_goodput(*a) * 2, lambda *a: good_goodput(*a) + 0.5])
def test_goodput_rejections_always_have_a_cause(bad):
    with pytest.raises(AssertionError, match="hint: "):
        lab10.check_goodput(bad, seed=0)
