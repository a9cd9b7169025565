"""Speculative decoding: the verifier keeps the target's distribution (chi-square, with a negative control),
and in the engine greedy output is token-identical to plain decoding for every proposer, with no KV block lost
after rejections, preemption, chunked prefill, stop conditions or prefix caching."""
from __future__ import annotations

import random

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.checks.teacher_forced import assert_greedy_outputs_agree
from lab_utils.engine.config import SpecConfig
from lab_utils.speculative import make_proposer, verify
from lab_utils.speculative.draft import DraftModelProposer
from lab_utils.speculative.ngram import prompt_lookup
from lab_utils.speculative.verify import (
    expected_tokens_per_step,
    verify_greedy,
    verify_sampling,
)

CHI2_CRIT_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


# ----------------------------------------------------------------------------------------- the verifier
def test_verify_greedy_keeps_the_agreeing_prefix_then_corrects():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == [3, 5, 7, 9]  # all kept + bonus
    assert verify_greedy(logits, [3, 4, 7]) == [3, 5]  # second rejected: the target's token replaces it
    assert verify_greedy(logits, [0, 5, 7]) == [3]
    assert verify_greedy(logits[:1], []) == [3]


def test_expected_tokens_per_step_formula():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.5, 2)


def _spec_samples(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first and second output token of 2-proposal speculative sampling with draft q, target p
    (the same p and q at every position, so each output position should be distributed as p)."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[0]
    first, second = torch.zeros(V), torch.zeros(V)
    target = p.expand(3, V)
    for _ in range(n):
        guesses = torch.multinomial(q, 2, replacement=True, generator=g).tolist()
        out = verify_sampling(target, guesses, q.expand(2, V), g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])  # a poor draft: mass in the wrong places


def test_speculative_sampling_matches_the_target_distribution():
    first, second = _spec_samples(P, Q, 6000, seed=0)
    assert _chi2(first, P) < CHI2_CRIT_DF5_P001, (first / first.sum(), P)
    assert _chi2(second, P) < CHI2_CRIT_DF5_P001, (second / second.sum(), P)


def test_chi_square_catches_a_broken_residual(monkeypatch):
    """Negative control: resampling from p instead of the residual max(0, p - q) biases the output towards
    the draft's tokens; the same test must then fail."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    first, _ = _spec_samples(P, Q, 6000, seed=0)
    assert _chi2(first, P) > CHI2_CRIT_DF5_P001


def test_deterministic_proposals_are_exact_too():
    """q = one-hot (n-gram): accept with probability p(x), otherwise draw from p without x."""
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(6)
    for _ in range(6000):
        counts[verify_sampling(P.expand(2, 6), [2], None, g)[0]] += 1
    assert _chi2(counts, P) < CHI2_CRIT_DF5_P001


def test_prompt_lookup():
    ids = [1, 2, 3, 4, 9, 1, 2, 3]
    assert prompt_lookup(ids, 2) == [4, 9]
    assert prompt_lookup([5, 6, 7], 3) == []
    assert prompt_lookup([7] * 8, 3, max_n=2) == [7, 7, 7]  # prefers an occurrence with a full continuation
    assert prompt_lookup([1, 2, 3, 1, 2], 4, min_n=3) == []


# ----------------------------------------------------------------------------------------- the engine
def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(100, 49152) for _ in range(rng.randint(3, 12))]
        out.append((base * 4)[: rng.randint(5, 40)])  # repeats, so n-gram lookup has something to find
    return out


def _draft(k: int) -> SpecConfig:
    """A draft-model config (the engine loads tiny-random; tests swap in the draft they want)."""
    return SpecConfig("draft", k, model="tiny-random")


def _generate(model_tok, prompts, spec=None, draft=None, max_tokens=24, params=None, **cfg):
    if draft is not None:  # build with the cheap proposer, then swap in the given draft (no model loading)
        eng = LLMEngine(model_tok, EngineConfig(speculative=SpecConfig("ngram", spec.num_speculative_tokens), **cfg),
                        device="cpu")
        eng.spec.proposer = DraftModelProposer(spec, model_tok[0], "cpu", draft_model=draft)
    else:
        eng = LLMEngine(model_tok, EngineConfig(speculative=spec, **cfg), device="cpu")
    outs = eng.generate(prompts, params or SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.block_manager.check_all_free()
    return eng, outs


@pytest.fixture(scope="module")
def other_draft():
    """A draft that disagrees with the target often (different random weights): exercises rejections."""
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float64, seed=7)[0]


CONFIGS = [
    dict(block_size=4, num_gpu_blocks=400),
    dict(block_size=16, max_num_batched_tokens=16, max_num_seqs=3),  # chunked prefills mixed with verifies
    dict(block_size=8, scheduler="continuous"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_is_token_identical(tiny64, other_draft, method, cfg):
    prompts = _prompts(6)
    _, base = _generate(tiny64, prompts, **cfg)
    spec = SpecConfig("ngram", 3) if method == "ngram" else _draft(3)
    draft = {"ngram": None, "draft-self": tiny64[0], "draft-other": other_draft}[method]
    eng, outs = _generate(tiny64, prompts, spec, draft=draft, **cfg)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    st = eng.stats()
    assert st["spec_num_verify_steps"] > 0 and 0.0 <= st["spec_acceptance_rate"] <= 1.0
    assert len(st["spec_acceptance_per_position"]) == 3
    if method == "draft-self":
        assert st["spec_acceptance_rate"] == 1.0  # the target as its own draft is always right
    if method == "draft-other":
        assert st["spec_acceptance_rate"] < 0.9  # rejections did happen, and rollback kept outputs exact


def test_spec_quantization_is_validated():
    with pytest.raises(ValueError, match="quantization='fp4' is invalid"):
        SpecConfig("draft", 2, quantization="fp4")
    with pytest.raises(ValueError, match="method='draft' only"):
        SpecConfig("ngram", 2, quantization="int8")
    from lab_utils import load_model

    mine = load_model("tiny-random", device="cpu", dtype=torch.float32)[0]
    with pytest.raises(ValueError, match="quantize the draft_model you pass yourself"):
        DraftModelProposer(SpecConfig("draft", 2, quantization="int8"), mine, "cpu", draft_model=mine)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "w8a8-g32"])
def test_quantized_self_draft_is_token_identical(method):
    """The target's own weights, quantized, as its draft (SpecConfig(model=<the target>, quantization=...)):
    outputs stay exactly the target's, and the draft agrees with it most of the time."""
    from lab_utils import load_model
    from lab_utils.quant.linear import Int4Linear, Int8Linear, W8A8GroupLinear, W8A8Linear

    target = load_model("tiny-random", device="cpu", dtype=torch.float32)
    prompts = _prompts(4)
    _, base = _generate(target, prompts, block_size=4, num_gpu_blocks=400)
    spec = SpecConfig("draft", 3, model="tiny-random", quantization=method)
    eng, outs = _generate(target, prompts, spec, block_size=4, num_gpu_blocks=400)
    # fp32: verifying 4 tokens in one pass sums in another order than decoding one at a time
    assert_greedy_outputs_agree(target[0], outs, base, f"speculative ({method} self-draft) vs plain decoding")
    kind = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear, "w8a8-g32": W8A8GroupLinear}[method]
    draft_modules = list(eng.spec.proposer.model.modules())
    assert any(isinstance(m, kind) for m in draft_modules), "the draft was not quantized"
    assert eng.stats()["spec_acceptance_rate"] > 0.5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_speculation(tiny64, other_draft, mode):
    prompts = _prompts(5, seed=3)
    cfg = dict(block_size=4, num_gpu_blocks=24, preemption_mode=mode)
    _, base = _generate(tiny64, prompts, max_tokens=30, **cfg)
    eng, outs = _generate(tiny64, prompts, _draft(4), draft=other_draft, max_tokens=30, **cfg)
    assert eng.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_stops_mid_chain_truncate(tiny64):
    prompts = _prompts(2, seed=5)
    _, base = _generate(tiny64, prompts, max_tokens=30)
    for out, prompt in zip(base, prompts):
        stop_tok = out.token_ids[len(out.token_ids) // 2]  # stop on a token that the output really contains
        params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
        _, ref = _generate(tiny64, [prompt], params=params)
        _, got = _generate(tiny64, [prompt], _draft(4), draft=tiny64[0], params=params)
        assert got[0].token_ids == ref[0].token_ids and got[0].finish_reason == "stop"
    for max_tokens in (1, 2, 7):  # max_tokens is never exceeded by an accepted chain
        _, got = _generate(tiny64, prompts, _draft(4), draft=tiny64[0], max_tokens=max_tokens)
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in got)


def test_rollback_frees_rejected_blocks(tiny64, other_draft):
    spec = _draft(6)
    eng = LLMEngine(tiny64, EngineConfig(speculative=SpecConfig("ngram", 6), block_size=2, num_gpu_blocks=200),
                    device="cpu")
    eng.spec.proposer = DraftModelProposer(spec, tiny64[0], "cpu", draft_model=other_draft)
    eng.add_request(_prompts(1, seed=2)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        for req in eng.scheduler.running:
            assert req.num_computed_tokens == req.num_tokens - 1  # only verified tokens count as computed
            assert len(req.block_table) <= eng.block_manager.blocks_needed(req.num_tokens)  # no spare blocks
    eng.block_manager.check_all_free()
    assert eng.stats()["spec_acceptance_rate"] < 1.0


def test_prefix_cache_holds_only_verified_tokens(tiny64, other_draft):
    """A later prompt that extends an earlier speculative request's output reuses its committed blocks: if a
    block had been committed with rejected guesses in it, this request's output would differ."""
    prompt = _prompts(1, seed=11)[0]
    spec = _draft(4)
    eng = LLMEngine(tiny64, EngineConfig(speculative=SpecConfig("ngram", 4), block_size=4, num_gpu_blocks=200),
                    device="cpu")
    eng.spec.proposer = DraftModelProposer(spec, tiny64[0], "cpu", draft_model=other_draft)
    first = eng.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    longer = prompt + first.token_ids
    second = eng.generate([longer], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert second.num_cached_tokens >= 16
    _, ref = _generate(tiny64, [longer], max_tokens=10, enable_prefix_caching=False)
    assert second.token_ids == ref[0].token_ids
    eng.block_manager.check_all_free()


def test_sampling_runs_and_is_seeded(tiny64, other_draft):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    runs = [_generate(tiny64, _prompts(3), _draft(3), draft=other_draft, params=params)[1] for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 20 for o in runs[0])


def test_stats_and_factory_errors(tiny64):
    assert isinstance(make_proposer(_draft(2), tiny64[0], "cpu"), DraftModelProposer)  # loads by name
    eng = LLMEngine(tiny64, EngineConfig(), device="cpu")
    assert eng.stats()["spec_acceptance_rate"] is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig("ngram", 0)
    with pytest.raises(ValueError, match="prompt_lookup"):
        make_proposer(SpecConfig("ngram", 2, prompt_lookup_min=3, prompt_lookup_max=2), tiny64[0], "cpu")
    with pytest.raises(ValueError, match="tokenizer"):
        small = tiny64[0]
        DraftModelProposer(SpecConfig("draft", 2), _FakeVocab(small), "cpu", draft_model=small)


class _FakeVocab:
    """A target whose vocabulary differs from the draft's (only its config is read)."""

    def __init__(self, model) -> None:
        import copy

        self.config = copy.copy(model.config)
        self.config.vocab_size += 1


# ------------------------------------------------------------------ a self-draft copies the target's prompt K/V
def test_self_draft_copies_the_targets_kv_instead_of_prefilling(tiny64, other_draft):
    """A draft with the target's weights (here: loaded by name, as SpecConfig(model=<the target>) does) takes the
    prompt's K/V from the target's paged cache instead of running its own prefill; a different draft does not.
    Output stays the target's, and the guesses are as good (a float64 self-draft is accepted every time)."""
    from lab_utils.speculative.draft import ADOPT_MIN_TOKENS, same_weights

    prompts = [p for p in _prompts(8, seed=5) if len(p) > ADOPT_MIN_TOKENS + 1][:4]
    assert prompts
    _, base = _generate(tiny64, prompts, block_size=4, num_gpu_blocks=400)
    eng, outs = _generate(tiny64, prompts, _draft(3), block_size=4, num_gpu_blocks=400)
    proposer = eng.spec.proposer
    assert proposer.shares_target_kv and same_weights(proposer.model, tiny64[0])
    assert proposer.num_adopted_tokens >= sum(len(p) - 1 for p in prompts)  # every prompt but its last token
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert eng.stats()["spec_acceptance_rate"] == 1.0
    assert not same_weights(other_draft, tiny64[0])
    eng, outs = _generate(tiny64, prompts, _draft(3), draft=other_draft, block_size=4, num_gpu_blocks=400)
    assert not eng.spec.proposer.shares_target_kv and eng.spec.proposer.num_adopted_tokens == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_adopted_kv_gives_the_same_guesses_as_a_draft_prefill(tiny64):
    """The proposer alone: K/V copied from the target's cache (a SimpleKVCache filled by the target) equal what
    the draft's own prefill computes, so the guesses are the same."""
    from lab_utils.models.kv_cache_simple import SimpleKVCache

    model = tiny64[0]
    ids = _prompts(1, seed=9)[0] * 3
    target_cache = SimpleKVCache.for_model(model, 1, 256)
    with torch.inference_mode():
        target_cache.forward(model, torch.tensor([ids[:-1]]))

    def read(start, end):
        return [(k[0, start:end], v[0, start:end]) for k, v in zip(target_cache.k, target_cache.v)]

    guesses = {}
    for adopt in (False, True):
        p = DraftModelProposer(_draft(4), model, "cpu", draft_model=model)
        p.request_id = "r"
        p.target_kv = (len(ids) - 1, read) if adopt else None
        guesses[adopt] = p.propose(ids, 4).token_ids
        assert p.num_adopted_tokens == (len(ids) - 1 if adopt else 0)
    assert guesses[True] == guesses[False]
