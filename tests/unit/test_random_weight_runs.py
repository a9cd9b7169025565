"""Random weights as a run mode (the lent GPU machine has no trained SmolLM2): the simulator, the token counter
and the tokenizer take a `-random` model of any registered shape, and a claim about a trained model's quality
is NOT JUDGED there while the same claim is judged with trained weights."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab_utils.checks.claims import RANDOM_WEIGHTS, has_random_weights, report, trained_only
from lab_utils.models.registry import REGISTRY
from lab_utils.paths import REPO_ROOT
from lab_utils.sim import model_spec

RANDOM_NAMES = sorted(n for n, s in REGISTRY.items() if s.kind == "random")


@pytest.mark.parametrize("name", RANDOM_NAMES)
def test_the_simulator_knows_every_random_shape(name):
    cfg = REGISTRY[name].config
    spec = model_spec(name)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["vocab_size"])
    assert model_spec(name, "fp16").dtype_bytes == 2


def test_a_random_shape_costs_what_the_trained_model_of_that_shape_costs():
    real, rnd = model_spec("smollm2-135m"), model_spec("smollm2-135m-random")
    assert (rnd.params, rnd.dtype_bytes, rnd.kv_bytes_per_token) == (real.params, real.dtype_bytes,
                                                                     real.kv_bytes_per_token)


def test_an_unknown_model_names_the_random_ones_too():
    with pytest.raises(ValueError, match="smollm2-135m-random"):
        model_spec("smollm2-135m-randm")


def test_token_counting_and_the_tokenizer_folder_need_no_prepared_model(tmp_path):
    code = ("from lab_utils.rag.queries import TokenCounter\n"
            "from lab_utils.models.loader import tokenizer_folder\n"
            "from lab_utils.models.tokenizer import load_tokenizer\n"
            "print(TokenCounter()(['hello world', 'a b c']))\n"
            "print(len(load_tokenizer(tokenizer_folder('smollm2-135m-random'))))\n")
    env = {**os.environ, "LAB_UTILS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    counts, size = r.stdout.split("\n")[:2]
    assert counts == "[2, 3]" and int(size) == 49152
    assert not (tmp_path / "cache").exists(), "counting tokens built something in the cache"


def test_random_weights_are_recognised_by_name():
    assert all(has_random_weights(n) for n in RANDOM_NAMES)
    assert not any(has_random_weights(n) for n in ("smollm2-135m", "smollm2-draft", None, "/some/folder"))


@pytest.mark.parametrize("verdict", [True, False, None])
def test_a_quality_claim_is_not_judged_on_random_weights_and_judged_otherwise(verdict, capsys):
    claim = ("int8 perplexity within 5% of fp32", verdict)
    text, ok = trained_only(claim, "smollm2-135m-random")
    assert ok is None and RANDOM_WEIGHTS in text and claim[0] in text
    report([(text, ok)])  # not judged: raises nothing, whatever the verdict was
    assert capsys.readouterr().out.startswith("NOT JUDGED  int8 perplexity")
    assert trained_only(claim, "smollm2-135m") == claim


# Per lab, each claim that needs trained weights, broken as its negative control breaks it: judged (FAIL) with
# trained weights, NOT JUDGED with random ones; and a claim that holds on any weights still fails on random ones.
def _lab05(path, value):
    from test_claims_lab05 import perturbed
    a, _, b = path.partition(".")
    return perturbed(a, b or None, value)


def _lab06(path, value):
    from test_claims_lab06 import with_
    return with_(path, value)


def _lab13(path, value):
    from test_claims_lab13 import good
    return dict(good(), **{path: value})


def _lab15(path, value):
    from test_claims_lab15 import _contexts_with, _random_router, _routing_r, good
    if path == "routing":
        return dict(good(), routing=_routing_r(_random_router(0)))
    if path == "routing.small_keeps_all":
        r = _routing_r()
        r["curve"][0] = r["curve"][0].__class__(**{**vars(r["curve"][0]), "kept": 1.0})
        return dict(good(), routing=r)
    return _contexts_with(tuple(path.split(".")[1:]), value)


QUALITY = [  # (lab, builder, what to break, its value, the claim's text)
    ("05", _lab05, "fp32_ppl", 45.0, "INT8 per-channel weights"),
    ("05", _lab05, "ppl.int8 per-tensor", 50.0, "per-channel beats per-tensor"),
    ("05", _lab05, "ppl.int4 g32", 80.0, "finer INT4 groups"),
    ("05", _lab05, "ppl.int8 per-channel A:int8", 50.0, "activations cost more"),
    ("05", _lab05, "ppl.QAT int4 g64", 75.0, "QAT beats PTQ"),
    ("05", _lab05, "ppl.GPTQ int4 g64", 80.0, "GPTQ beats"),
    ("05", _lab05, "kv_ppl.fp8_e4m3", 60.0, "FP8 E4M3 KV cache: perplexity"),
    ("05", _lab05, "kv_ppl.int8", 52.0, "per-vector INT8 KV"),
    ("06", _lab06, "agreement.draft", 0.05, "distilled draft agrees"),
    ("06", _lab06, "ppl.draft", 5000.0, "held-out perplexity"),
    ("13", _lab13, "constrained_valid_rate", 0.98, "schema-valid"),
    ("13", _lab13, "prompt_valid_rate", 1.0, "prompt alone"),
    ("15", _lab15, "routing", None, "above the straight line"),
    ("15", _lab15, "routing.small_keeps_all", None, "routing has something to trade"),
    ("15", _lab15, "contexts.kept.last", 1.0, "every shorter context lost answers"),
]
ANY_WEIGHTS = [  # claims judged on random weights too: their negative controls still fail there
    ("05", _lab05, "qat_losses", [0.5, 0.4, 0.9, 0.8], "loss falls"),
    ("05", _lab05, "saved8", 0.5, "stored INT8 saves"),
    ("06", _lab06, "live_losses", [5.0, 5.2, 6.0, 7.0, 8.0, 8.5, 8.9, 9.0], "KD loss falls"),
    ("06", _lab06, "cost_ratio", 3.0, "cheaper per decode step"),
    ("13", _lab13, "yours_same_as_reference", False, "your mask step"),
    ("15", _lab15, "contexts.kept.full", 0.75, "the check agrees with generation"),
]


def _module(lab: str):
    import importlib
    return importlib.import_module(f"lab_utils.checks.lab{lab}")


@pytest.mark.parametrize("lab, build, path, value, text", QUALITY, ids=[f"{q[0]}:{q[4]}" for q in QUALITY])
def test_a_quality_claim_is_judged_on_trained_weights_and_not_judged_on_random_ones(lab, build, path, value, text,
                                                                                     capsys):
    mod, r = _module(lab), build(path, value)
    with pytest.raises(AssertionError, match=text):
        mod.assert_claims(dict(r, model="smollm2-135m"), show=False)
    mod.assert_claims(dict(r, model="smollm2-135m-random"))  # raises nothing
    line = next(ln for ln in capsys.readouterr().out.splitlines() if text in ln)
    assert line.startswith("NOT JUDGED") and RANDOM_WEIGHTS in line


@pytest.mark.parametrize("lab, build, path, value, text", ANY_WEIGHTS, ids=[f"{q[0]}:{q[4]}" for q in ANY_WEIGHTS])
def test_a_claim_that_holds_on_any_weights_is_judged_on_random_ones(lab, build, path, value, text):
    with pytest.raises(AssertionError, match=text):
        _module(lab).assert_claims(dict(build(path, value), model="smollm2-135m-random"), show=False)
