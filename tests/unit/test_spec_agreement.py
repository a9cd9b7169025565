"""Bug checks of the proposers that need target features: what the engine proposes and accepts is what the same
proposer computes outside the engine, teacher-forced, from one plain forward of the target (the training-time
path). Covers the feature/token alignment (EAGLE: f_t with the embedding of x_t+1; Medusa head i: token t+2+i),
the layer and dtype of the features, EAGLE's per-request history, and the acceptance bookkeeping. Tiny-random
model, random (non-identity) heads: seconds."""
from __future__ import annotations

import pytest
import torch

from lab_utils.engine.config import EngineConfig, SpecConfig
from lab_utils.speculative.agreement import ProposalRecorder, accepted_from_text, replay, teacher_forced
from lab_utils.speculative.eagle import EagleHead, eagle_config_for
from lab_utils.speculative.training.train import acceptance_summary
from lab_utils.speculative.medusa import CONFIG_NAME as MEDUSA_CONFIG
from lab_utils.speculative.medusa import MedusaHeads, save_heads, top_tokens

PROMPTS = [[5, 17, 99, 3, 40, 41, 42, 7], [9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def tiny():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float32)


def _random_heads(method: str, model, folder, vocab: torch.Tensor | None = None) -> str:
    """Heads with random weights (an untrained Medusa head is the identity, which would hide an offset bug)."""
    torch.manual_seed(1)
    if method == "medusa":
        heads = MedusaHeads(model.config.hidden_size, 3)
        for p in heads.parameters():
            torch.nn.init.normal_(p, 0, 0.5)
        cfg, name = heads.config(), MEDUSA_CONFIG
    else:
        from lab_utils.speculative.eagle import CONFIG_NAME

        heads = EagleHead(eagle_config_for(model.config), window=4)
        for p in heads.parameters():
            torch.nn.init.normal_(p, 0, 0.2)
        cfg, name = heads.config(), CONFIG_NAME
    save_heads(heads, {**cfg, "target": "tiny-random", "vocab_size": model.config.vocab_size}, folder, name, vocab)
    return str(folder)


def _run(model_tok, spec: SpecConfig, max_tokens: int = 24):
    from lab_utils import LLMEngine, SamplingParams

    eng = LLMEngine(model_tok, EngineConfig(max_num_seqs=4, num_gpu_blocks=64, block_size=4,
                                            max_num_batched_tokens=32, speculative=spec), device="cpu")
    rec = ProposalRecorder(eng)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    rec.stop()
    eng.block_manager.check_all_free()
    prompts = {o.request_id: list(o.prompt_token_ids) for o in outs}
    texts = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outs}
    return eng, rec, prompts, texts


@pytest.mark.parametrize("method,vocab", [("medusa", None), ("eagle", None), ("eagle", 64)])
def test_engine_proposals_equal_teacher_forced_replay(tiny, tmp_path, method, vocab):
    model, tok = tiny
    draft_vocab = None if vocab is None else top_tokens(torch.arange(vocab * 2) % model.config.vocab_size, vocab)
    folder = _random_heads(method, model, tmp_path / method, draft_vocab)
    eng, rec, prompts, texts = _run((model, tok), SpecConfig(method, 3, model=folder))
    assert len(rec.calls) > 10
    rows = replay(eng.spec.proposer, model, rec.calls, prompts, texts)
    # the rows the engine hands over are the target's final-norm states of the same positions, same dtype
    assert max(d for _, _, d in rows) < 1e-3
    assert all(c.hidden.dtype == model.dtype for c in rec.calls)
    same = sum(e == o for e, o, _ in rows)
    assert same == len(rows), f"{len(rows) - same} of {len(rows)} engine proposals differ from the offline replay"
    if draft_vocab is not None:
        assert all(t in set(draft_vocab.tolist()) for c in rec.calls for t in c.guesses)
    # the acceptance the engine counted is the acceptance its guesses imply on the final text
    kept = accepted_from_text(rec.calls, texts)
    assert sum(kept) == eng.spec.stats.num_accepted
    assert sum(len(c.guesses) for c in rec.calls) == eng.spec.stats.num_proposed
    for i in range(3):
        assert eng.spec.stats.accepted_at[i] == sum(n > i for n in kept)


def test_replay_catches_features_one_position_off(tiny, tmp_path):
    """Negative control: hand the proposer the rows of one position earlier (the classic off-by-one) and the
    replay flags both the rows and the guesses."""
    model, tok = tiny
    folder = _random_heads("medusa", model, tmp_path / "m")
    eng, rec, prompts, texts = _run((model, tok), SpecConfig("medusa", 3, model=folder), max_tokens=12)
    feats = {rid: model.hidden_states(torch.tensor([ids]))[0] for rid, ids in texts.items()}
    for c in rec.calls:  # what a buggy hook would have handed over: row p-1 instead of row p
        L = len(c.token_ids)
        c.hidden = feats[c.request_id][L - 3: L - 2]
        c.guesses = eng.spec.proposer.propose(c.token_ids, 3, hidden=c.hidden).token_ids
    rows = replay(eng.spec.proposer, model, rec.calls, prompts, texts)
    assert min(d for _, _, d in rows) > 1e-2
    assert sum(e != o for e, o, _ in rows) >= len(rows) // 4   # the tiny model repeats tokens: some still agree


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_teacher_forced_first_position_matches_engine_at_k1(tiny, tmp_path, method):
    """With k=1 the engine asks at every position it reaches; each guess is the teacher-forced guess at that
    position, so the engine's acceptance equals the teacher-forced top-1 over those same positions."""
    model, tok = tiny
    folder = _random_heads(method, model, tmp_path / method)
    eng, rec, prompts, texts = _run((model, tok), SpecConfig(method, 1, model=folder))
    for rid, ids in texts.items():
        P = len(prompts[rid])
        correct = teacher_forced(eng.spec.proposer, model, ids, P, 1)[:, 0]      # position L = P + 1 + row
        asked = [len(c.token_ids) for c in rec.calls if c.request_id == rid and c.guesses]
        engine_kept = sum(accepted_from_text([c for c in rec.calls if c.request_id == rid and c.guesses], texts))
        assert engine_kept == sum(bool(correct[L - P - 1]) for L in asked if L - P - 1 < len(correct))


def test_acceptance_summary_conditional():
    s = acceptance_summary(torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool))
    assert s["top1"] == [pytest.approx(2 / 3, abs=1e-4)] * 3
    assert s["conditional"][1] == 0.5 and s["mean_accepted"] == 1.0


def test_payoff_arithmetic():
    from lab_utils.speculative.payoff import breakeven_acceptance, expected_tokens, predicted_speedup

    assert expected_tokens([0.5, 0.5]) == 1.75 and expected_tokens([]) == 1.0
    assert predicted_speedup(2.0, 4, 0.1, 1.0) == pytest.approx(2.0 / 1.4)
    a = breakeven_acceptance(4, 0.1, 1.2)
    assert expected_tokens([a] * 4) == pytest.approx(1.6, abs=1e-4)
    assert breakeven_acceptance(2, 0.1, 1.0) < a            # a cheaper verify (a GPU's ~1x) pays sooner
    assert breakeven_acceptance(1, 0.6, 1.5) is None         # 2 tokens can never pay for a cost of 2.1
    with pytest.raises(ValueError, match="tokens_per_verify"):
        predicted_speedup(0.5, 4, 0.1, 1.0)


def test_check_payoff_accepts_figures_that_agree():
    from lab_utils.speculative.payoff import breakeven_acceptance, check_payoff

    rows = {"eagle": dict(tokens_per_verify=1.8, step_cost=0.2, measured=0.85),   # predicted 1.8 / 1.96 = 0.92
            "self-draft": dict(tokens_per_verify=3.7, step_cost=0.15, measured=1.9)}
    lines = check_payoff(rows, verify_cost=1.36, k=3)
    assert "does not pay" in lines[0] and "pays" in lines[1]
    assert breakeven_acceptance(3, 0.0, 0.9) == 0.0 and breakeven_acceptance(3, 0.05, 1.0) > 0
