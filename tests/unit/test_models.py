"""The model layer against a reference: our Llama vs transformers' on the prepared SmolLM2 folder.

SmolLM2 and the HF model are loaded once per module; generation runs the 5 prompts as one batch (cropped to a
common length, so no padding can make the two implementations disagree for reasons that are not theirs).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from lab_utils.device import resolve_device, time_fn
from lab_utils.models.generate import generate_cached, generate_naive
from lab_utils.models.kv_cache_simple import SimpleKVCache
from lab_utils.models.llama import rope_inv_freq
from lab_utils.models.loader import build_random, load_model, model_folder
from lab_utils.models.registry import REGISTRY

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
]
NEW_TOKENS = 32

needs_cuda = pytest.mark.needs_cuda
skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    return model, tok


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_folder("smollm2-135m")), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, like ours
    return hf


@pytest.fixture(scope="module")
def tiny():
    return build_random(REGISTRY["tiny-random"].config, seed=0).eval()


def _batch(tok) -> torch.Tensor:
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    n = min(len(r) for r in rows)
    assert n >= 4, f"prompts tokenize too short ({n} tokens) to be a meaningful test"
    return torch.tensor([r[:n] for r in rows])


def _same_up_to_a_near_tie(model, a: torch.Tensor, b: torch.Tensor) -> None:
    """Two greedy generations [T] of one prompt by numerically different paths: identical, or parting where the
    model's two candidates on the shared prefix (the one position both scored alike) are within the float32
    near-tie tolerance; every later token then follows another prefix and is not compared."""
    from lab_utils.checks.teacher_forced import same_or_near_tie

    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    ok, gap = same_or_near_tie(model, [], a.tolist(), b.tolist())  # the prompt is the shared start of both
    assert ok, f"{a.tolist()} vs {b.tolist()}: they part at a logit gap of {gap:.3g}, wider than a near-tie"


# --- equivalence with transformers ------------------------------------------------------------------------


def test_logits_match_hf(smollm2, hf_model):
    model, tok = smollm2
    from lab_utils.models.tokenizer import chat_prompt

    long = chat_prompt(tok, "Explain in two sentences why the sky is blue, and what Rayleigh scattering is.")
    for text in (PROMPTS[0], long):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ours, ref = model(ids), hf_model(ids).logits
        assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-3, f"max |logit diff| = {diff:.2e} > 1e-3 on a {ids.shape[1]}-token prompt"


def test_greedy_matches_hf_generate(smollm2, hf_model):
    """Teacher-forced against transformers (two implementations: sums in another order): HF scores the tokens our
    generators produced; each of our tokens is HF's argmax wherever HF's top-2 margin exceeds the float32 near-tie
    tolerance, and our cached path's logits over those same tokens lie within 1e-3 of HF's."""
    from lab_utils.checks.teacher_forced import compare, rounding_tie

    model, tok = smollm2
    ids = _batch(tok)
    n = ids.shape[1]
    # all 5 prompts through the cached path; the naive path (O(n^2) work) on the first 2 keeps the suite fast
    for name, gen, rows in (("cached", generate_cached, 5), ("naive", generate_naive, 2)):
        out = gen(model, ids[:rows], NEW_TOKENS)
        assert out.shape == (rows, n + NEW_TOKENS) and torch.equal(out[:, :n], ids[:rows]), name
        with torch.no_grad():
            ref = hf_model(out, attention_mask=torch.ones_like(out)).logits[:, n - 1 : -1].float()
            cache = SimpleKVCache.for_model(model, batch=rows, max_len=n + NEW_TOKENS)
            steps = [cache.forward(model, out[:, :n])[:, -1:]]
            steps += [cache.forward(model, out[:, t : t + 1]) for t in range(n, n + NEW_TOKENS - 1)]
            ours = torch.cat(steps, dim=1).float()
        tie = rounding_tie(torch.float32, ref)
        for i, prompt in enumerate(PROMPTS[:rows]):
            chosen = torch.nn.functional.one_hot(out[i, n:], ref.shape[-1]).float()  # our tokens as "logits"
            picked = compare(ref[i], chosen, tie)
            assert picked.decisive_fraction == 1.0, (
                f"{name} path, prompt {prompt!r}: our greedy tokens are not HF's argmax: {picked.describe()}; "
                f"ours {tok.decode(out[i])!r}")
            scored = compare(ref[i], ours[i], tie)
            assert scored.decisive_fraction == 1.0 and scored.max_abs_diff <= 1e-3, (
                f"{name} tokens, prompt {prompt!r}, our cached logits vs HF's: {scored.describe()}")


def test_batched_generation_equals_one_by_one(smollm2):
    model, tok = smollm2
    ids = _batch(tok)[:2]
    both = generate_cached(model, ids, 4)
    for i in range(2):  # a 2-row matmul may sum in another order than a 1-row one: judged at the first difference
        _same_up_to_a_near_tie(model, both[i], generate_cached(model, ids[i : i + 1], 4)[0])


# --- KV cache and generation on the tiny model (fast, weights do not matter) -----------------------------


def test_cache_prefill_plus_decode_equals_full_forward(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = tiny(ids)
    cache = SimpleKVCache.for_model(tiny, batch=3, max_len=16)
    parts = [cache.forward(tiny, ids[:, :7]), cache.forward(tiny, ids[:, 7:9])]
    parts += [cache.forward(tiny, ids[:, t : t + 1]) for t in range(9, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.length == 12


def test_naive_and_cached_agree_on_tiny(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    a, b = generate_naive(tiny, ids, 10), generate_cached(tiny, ids, 10)
    assert a.shape == b.shape == (2, 15)
    for i in range(2):  # a full forward and cached decode steps are different kernels (float32)
        _same_up_to_a_near_tie(tiny, a[i], b[i])
    assert torch.equal(a[:, :5], ids), "the prompt must be returned unchanged"


def test_on_token_sees_every_token_in_order(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    seen = []
    out = generate_cached(tiny, ids, 6, on_token=lambda step, nxt: seen.append((step, int(nxt[0, 0]))))
    assert [s for s, _ in seen] == list(range(6))
    assert [t for _, t in seen] == out[0, 4:].tolist()


def test_cache_overflow_and_batch_mismatch_raise(tiny):
    cache = SimpleKVCache.for_model(tiny, batch=1, max_len=4)
    with pytest.raises(ValueError, match="max_len=4"):
        cache.forward(tiny, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch=1"):
        cache.forward(tiny, torch.zeros(2, 3, dtype=torch.long))


# --- bad input ---------------------------------------------------------------------------------------------


def test_prompt_longer_than_context_raises_with_both_lengths(tiny):
    ctx = tiny.config.max_position_embeddings  # 1024
    too_long = torch.zeros(1, ctx + 10, dtype=torch.long)
    with pytest.raises(ValueError) as e:
        tiny(too_long)
    assert str(ctx + 10) in str(e.value) and str(ctx) in str(e.value)
    for gen in (generate_naive, generate_cached):
        with pytest.raises(ValueError) as e:
            gen(tiny, torch.zeros(1, ctx - 2, dtype=torch.long), 5)
        assert str(ctx - 2) in str(e.value) and str(ctx) in str(e.value) and str(ctx + 3) in str(e.value)


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ValueError) as e:
        load_model("no-such-model-xyz", device="cpu")
    msg = str(e.value)
    assert "no-such-model-xyz" in msg and "smollm2-135m" in msg and "tiny-random" in msg


def test_folder_without_config_lists_known_names(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert "config.json" in msg and "smollm2-135m" in msg and "tiny-random" in msg


# --- RoPE scaling ------------------------------------------------------------------------------------------

LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


def test_rope_scaling_variants_are_sane():
    base = rope_inv_freq(64, 500000.0)
    assert base.shape == (32,) and torch.all(base[1:] < base[:-1]) and base[0] == 1.0
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, dict(rope_type="linear", factor=4.0)), base / 4)
    l3 = rope_inv_freq(64, 500000.0, LLAMA3)
    wavelen = 2 * torch.pi / base
    hi = wavelen < 8192 / 4  # short wavelengths: untouched
    lo = wavelen > 8192 / 1  # long wavelengths: slowed by `factor`
    assert hi.any() and lo.any()
    torch.testing.assert_close(l3[hi], base[hi])
    torch.testing.assert_close(l3[lo], base[lo] / 32)
    mid = ~hi & ~lo  # in between: interpolated, so within [base/factor, base]
    assert torch.all(l3[mid] <= base[mid] + 1e-9) and torch.all(l3[mid] >= base[mid] / 32 - 1e-9)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, dict(rope_type="yarn", factor=2.0))


@pytest.mark.parametrize("scaling", [dict(rope_type="linear", factor=4.0), LLAMA3])
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(scaling, rope_theta=500000.0)
    cfg = HFConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=rp,
                   max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, scaling), ref.float(), atol=1e-7, rtol=1e-6)


def test_scaled_rope_model_runs_and_config_reads_rope_parameters():
    cfg = dict(REGISTRY["tiny-random"].config, rope_parameters=dict(LLAMA3, rope_theta=500000.0))
    cfg.pop("rope_theta")
    model = build_random(cfg).eval()
    assert model.config.rope_theta == 500000.0 and model.config.rope_scaling["rope_type"] == "llama3"
    with torch.no_grad():
        logits = model(torch.arange(20).unsqueeze(0))
    assert logits.shape == (1, 20, 49152) and torch.isfinite(logits).all()


# --- device and timing -------------------------------------------------------------------------------------


def test_auto_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device(None).type == expected
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_cuda_request_without_cuda_raises():
    with pytest.raises(ValueError, match="no CUDA"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA"):
        load_model("tiny-random", device="cuda")


def test_bad_device_name_raises():
    with pytest.raises(ValueError, match="mps"):
        resolve_device("mps")


def test_time_fn_warms_up_and_takes_medians():
    calls = []
    t = time_fn(lambda: calls.append(1), device="cpu", warmup=2, repeat=5)
    assert len(calls) == 7 and len(t.times) == 5
    assert all(x >= 0 for x in t.times) and min(t.times) <= t.median <= max(t.times)


@needs_cuda
@skip_without_cuda
def test_cuda_model_matches_cpu_and_cuda_timing(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cpu = tiny(ids)
        gpu_model = build_random(REGISTRY["tiny-random"].config, seed=0).eval().to("cuda")
        gpu = gpu_model(ids.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-3, rtol=1e-3)
    assert torch.equal(generate_cached(gpu_model, ids, 8), generate_naive(gpu_model, ids, 8))
    t = time_fn(lambda: gpu_model(ids.cuda()), device="cuda", warmup=1, repeat=3)
    assert len(t.times) == 3 and t.median > 0
