"""Random-weight models need nothing that `prepare` builds: SmolLM2's tokenizer comes from the committed draft's
folder, and the weights are drawn on the model's own device with a seeded generator of that device."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lab_utils.models.loader import build_random, load_model
from lab_utils.models.registry import REGISTRY, SMOLLM2_TOKENIZER, data_models, prepared_dir
from lab_utils.paths import REPO_ROOT


def test_random_models_load_with_an_empty_cache_and_build_nothing(tmp_path):
    code = ("from lab_utils.models.loader import load_model\n"
            "m, tok = load_model('tiny-random', device='cpu')\n"
            "print(len(tok), tok.eos_token, tok('hello world', add_special_tokens=False).input_ids)\n")
    env = {**os.environ, "LAB_UTILS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    size, eos, ids = r.stdout.split(maxsplit=2)
    assert int(size) == 49152 and eos == "<|im_end|>" and ids.strip().startswith("[")
    assert not (tmp_path / "cache").exists(), "loading a random-weight model built something in the cache"


def test_every_random_model_takes_the_committed_smollm2_tokenizer():
    folder = data_models()[SMOLLM2_TOKENIZER]
    assert (folder / "tokenizer.json").exists()
    for spec in REGISTRY.values():
        if spec.kind == "random":
            assert spec.tokenizer_from == SMOLLM2_TOKENIZER and spec.config["vocab_size"] == 49152


def test_the_committed_tokenizer_is_the_prepared_models_own():
    prepared = prepared_dir("smollm2-135m")
    if not (prepared / "tokenizer.json").exists():
        pytest.skip("smollm2-135m is not prepared here (python -m lab_utils prepare)")
    committed = data_models()[SMOLLM2_TOKENIZER]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (committed / name).read_bytes() == (prepared / name).read_bytes(), name


def test_build_random_is_seeded_tied_and_on_the_requested_device():
    cfg = REGISTRY["tiny-random"].config
    a, b, c = build_random(cfg, seed=3), build_random(cfg, seed=3), build_random(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.lm_head.weight is a.model.embed_tokens.weight
    for name, p in a.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and torch.isfinite(p).all(), name
        if "norm" in name:
            assert torch.all(p == 1.0), name
        else:
            assert abs(float(p.detach().std()) - 0.02) < 0.002, name
    if not torch.cuda.is_available():  # on a machine with a GPU the draw is the GPU's (next test)
        # the CPU weights are those of a serial draw in parameter order (earlier recorded results stay valid)
        gen = torch.Generator().manual_seed(3)
        first = next(p for n, p in a.named_parameters() if "norm" not in n)
        assert torch.equal(first, torch.randn(first.shape, generator=gen) * 0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_random_weights_are_the_same_on_every_device_of_a_machine():
    """A CPU engine (lab 09's ranks, lab 10's and 14's workers) and a CUDA engine of one seed compare one model."""
    cfg = REGISTRY["tiny-random"].config
    cpu, gpu = build_random(cfg, seed=5, device="cpu"), build_random(cfg, seed=5, device="cuda")
    assert next(cpu.parameters()).device.type == "cpu" and next(gpu.parameters()).device.type == "cuda"
    sg = gpu.state_dict()
    assert all(torch.equal(v, sg[k].cpu()) for k, v in cpu.state_dict().items())
    assert cpu.lm_head.weight is cpu.model.embed_tokens.weight


def test_load_model_of_a_random_shape_works_offline():
    model, tok = load_model("tiny-random", device="cpu")
    ids = tok("The capital of France is", add_special_tokens=False).input_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))
    assert logits.shape == (1, len(ids), 49152)
