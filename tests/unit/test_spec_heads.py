"""Medusa heads and the EAGLE head: shapes, the shipped weights, proposals the engine can verify, held-out
agreement with the target far above an untrained head, training that lowers the loss, and in the engine
token-identical greedy output with every KV block returned."""
from __future__ import annotations

import json

import pytest
import torch

from lab_utils.engine.config import SpecConfig
from lab_utils.models.llama import LlamaConfig
from lab_utils.paths import DATA_DIR
from lab_utils.speculative.eagle import EagleHead, EagleProposer, eagle_config_for, load_eagle
from lab_utils.speculative.training.data import _chat, generate_with_features
from lab_utils.speculative.training.train import (
    eagle_batch,
    eagle_loss,
    eval_eagle,
    eval_medusa,
    init_eagle,
    medusa_loss,
    medusa_table,
    train_eagle,
    train_medusa,
)
from lab_utils.speculative.medusa import MedusaHeads, MedusaProposer, VocabHead, load_medusa, top_tokens

TINY = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2)


# ----------------------------------------------------------------------------------------- modules
def test_medusa_heads_shapes_and_identity_start():
    heads = MedusaHeads(32, 3)
    h = torch.randn(5, 32)
    out = heads(h)
    assert out.shape == (3, 5, 32)
    assert torch.equal(out[1], h)  # zero-initialised: an untrained head copies the target's own guess
    assert heads(h, 2).shape == (2, 5, 32)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(32, 0)


def test_eagle_head_shapes_and_attention_window():
    torch.manual_seed(0)
    head = EagleHead(eagle_config_for(TINY), window=3)
    f, e = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    out = head(f, e)
    assert out.shape == (2, 7, 32)
    f2 = f.clone()
    f2[:, 0] += 5.0  # row 0 is outside the 3-row window of rows 3..6
    out2 = head(f2, e)
    assert torch.allclose(out[:, 3:], out2[:, 3:], atol=1e-6)
    assert not torch.allclose(out[:, :3], out2[:, :3])
    init_eagle(head)
    # starts as "the next feature is the current one" (+ a little of the token embedding)
    assert torch.allclose(head(f, torch.zeros_like(e)), f, atol=1e-5)


# ----------------------------------------------------------------------------------------- shipped weights
@pytest.mark.parametrize("name,config_name", [("smollm2-medusa", "medusa_config.json"),
                                              ("smollm2-eagle", "eagle_config.json")])
def test_shipped_heads_are_small_and_carry_no_lm_head(name, config_name):
    from safetensors import safe_open

    folder = DATA_DIR / "models" / name
    cfg = json.loads((folder / config_name).read_text())
    assert cfg["target"] == "smollm2-135m" and cfg["hidden_size"] == 576
    assert not (folder / "config.json").exists()  # the model registry must not take it for a full model
    assert "Reproduce" in (folder / "README.md").read_text()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in names}
        dtypes = {f.get_tensor(k).dtype for k in names if k != "draft_vocab"}
    assert dtypes == {torch.float16}
    assert all(49152 not in s for s in shapes.values())  # the tied embedding / lm_head is the target's
    heads = load_medusa() if "medusa" in name else load_eagle()
    assert all(torch.isfinite(p).all() for p in heads.parameters())
    if heads.vocab is not None:  # a draft vocabulary: distinct, sorted token ids, the size the config states
        v = heads.vocab
        assert v.dtype == torch.int64 and len(v) == cfg["draft_vocab"] and bool((v[1:] > v[:-1]).all())
        assert 0 <= int(v[0]) and int(v[-1]) < 49152


def test_draft_vocabulary_scores_only_its_tokens_and_samples_exactly(tiny64):
    """VocabHead: logits over the draft vocabulary's rows of the lm_head, token ids mapped back, and a sampled
    distribution spread back over the whole vocabulary with zeros elsewhere (so the verifier stays exact)."""
    model, _ = tiny64
    vocab = top_tokens(torch.tensor([7, 7, 7, 3, 3, 900, 900, 5, -100]), 3)
    assert vocab.tolist() == [3, 7, 900]
    lm = VocabHead(model, vocab)
    h = torch.randn(2, model.config.hidden_size, dtype=model.dtype)
    full = model.logits(h)
    assert torch.allclose(lm(h), full[:, vocab])
    assert lm.tokens(lm(h).argmax(-1)).tolist() == [int(vocab[full[i, vocab].argmax()]) for i in range(2)]
    p = lm.full(torch.softmax(lm(h), -1))
    assert p.shape == full.shape and torch.allclose(p.sum(-1), torch.ones(2, dtype=p.dtype))
    assert float(p[:, [0, 1, 2, 4, 5, 6]].abs().sum()) == 0.0
    assert VocabHead(model, None).tokens(torch.tensor([5])).tolist() == [5]


def test_unknown_heads_name_is_a_clear_error():
    with pytest.raises(ValueError, match="not found"):
        load_medusa("no-such-heads")


# ----------------------------------------------------------------------------------------- proposers
@pytest.mark.parametrize("cls,method", [(MedusaProposer, "medusa"), (EagleProposer, "eagle")])
def test_proposer_returns_k_valid_tokens_and_distributions(smollm2, cls, method):
    model, tok = smollm2
    ids = _chat(tok, "What is the capital of France?")
    hidden = model.hidden_states(torch.tensor([ids]))[0].detach()
    prop = cls(SpecConfig(method, 3), model, "cpu")
    assert prop.needs_hidden
    greedy = prop.propose(ids, 3, hidden[-3:-1])  # rows of positions len-3, len-2 (see base.py)
    assert len(greedy.token_ids) == 3 and greedy.probs is None
    assert all(0 <= t < model.config.vocab_size for t in greedy.token_ids)
    torch.manual_seed(0)
    sampled = prop.propose(ids, 3, hidden[-2:-1], temperature=0.8)
    assert sampled.probs.shape == (3, model.config.vocab_size)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(3), atol=1e-4)
    assert all(float(sampled.probs[i, t]) > 0 for i, t in enumerate(sampled.token_ids))
    assert prop.propose(ids, 0, hidden[-2:-1]).token_ids == []
    with pytest.raises(ValueError, match="hidden"):
        prop.propose(ids, 3, None)


def test_eagle_keeps_a_requests_rows_across_calls(smollm2):
    """Two calls that hand over 1 then 2 new rows see the same context as one call given all 3 rows."""
    model, tok = smollm2
    ids = _chat(tok, "Write a haiku about the sea.")
    L = len(ids)
    hidden = model.hidden_states(torch.tensor([ids]))[0].detach()
    with_history = EagleProposer(SpecConfig("eagle", 3), model, "cpu")
    with_history.request_id = "r1"
    with_history.propose(ids[: L - 2], 3, hidden[L - 4: L - 3])       # row of position L-4
    got = with_history.propose(ids, 3, hidden[L - 3: L - 1])           # rows of positions L-3, L-2
    fresh = EagleProposer(SpecConfig("eagle", 3), model, "cpu")
    want = fresh.propose(ids, 3, hidden[L - 4: L - 1])
    assert got.token_ids == want.token_ids
    start, rows = with_history.history["r1"]
    assert start == L - 4 and rows.shape[0] == 3
    with_history.release("r1")
    assert "r1" not in with_history.history


def test_heads_reject_a_target_of_another_width(tiny64):
    with pytest.raises(ValueError, match="hidden size"):
        MedusaProposer(SpecConfig("medusa", 3), tiny64[0], "cpu")


# ----------------------------------------------------------------------------------------- quality, training
@pytest.fixture(scope="module")
def heldout(smollm2):
    """The target's own greedy continuations of prompts unlike the training prompts (+ its features)."""
    from lab_utils.speculative.training.data import Sequence

    model, tok = smollm2
    prompts = [_chat(tok, "Describe how a bicycle works."), _chat(tok, "Why do cats purr?"),
               tok.encode("FERDINAND. There be some sports are painful, and their labour")]
    eos = {tok.eos_token_id}
    seqs = [Sequence(torch.tensor(i), h, g, "test") for i, h, g in generate_with_features(model, prompts, 40, eos)]
    return seqs, [len(p) for p in prompts]  # + where each answer starts: only generated positions are scored


def test_trained_medusa_head0_beats_an_untrained_head(smollm2, heldout):
    model, _ = smollm2
    seqs, starts = heldout
    trained = eval_medusa(load_medusa(), model, seqs, k=2, starts=starts)
    untrained = eval_medusa(MedusaHeads(576, 2), model, seqs, k=2, starts=starts)
    assert trained["positions"] >= 30
    assert trained["top1"][0] >= 0.2 and trained["top1"][0] >= untrained["top1"][0] + 0.15, (trained, untrained)


def test_trained_eagle_step0_beats_an_untrained_head(smollm2, heldout):
    model, _ = smollm2
    seqs, starts = heldout
    trained = eval_eagle(load_eagle(), model, seqs, k=2, starts=starts)
    untrained = eval_eagle(init_eagle(EagleHead(eagle_config_for(model.config))), model, seqs, k=2, starts=starts)
    assert trained["top1"][0] >= 0.2 and trained["top1"][0] >= untrained["top1"][0] + 0.15, (trained, untrained)


def test_training_lowers_the_loss(smollm2, heldout):
    """The loss on a fixed batch (not the noisy per-step loss) falls after a few steps of training."""
    model, _ = smollm2
    heldout = heldout[0]
    torch.manual_seed(0)
    heads = MedusaHeads(576, 2)
    H, L = medusa_table(heldout, 2)
    with torch.no_grad():
        before = float(medusa_loss(heads, model.lm_head, H.float(), L)[0])
    train_medusa(heads, model, heldout, steps=15, batch=64, lr=3e-3, log=lambda *_: None)
    with torch.no_grad():
        after = float(medusa_loss(heads, model.lm_head, H.float(), L)[0])
    assert after < 0.8 * before, (before, after)

    head = init_eagle(EagleHead(eagle_config_for(model.config), window=4))
    g = torch.Generator().manual_seed(1)
    batch = eagle_batch(heldout, 4, 16, g)
    with torch.no_grad():
        before = float(eagle_loss(head, model, *batch, width=4, noise=0.0, ce_weight=0.5, unroll=False)[0])
    train_eagle(head, model, heldout, steps=15, batch=4, length=16, lr=3e-3, log=lambda *_: None)
    with torch.no_grad():
        after = float(eagle_loss(head, model, *batch, width=4, noise=0.0, ce_weight=0.5, unroll=False)[0])
    assert after < 0.8 * before, (before, after)


# ----------------------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def smollm2_f64():
    """fp64, so that verifying k+1 rows at once cannot flip a near-tie argmax through rounding."""
    from lab_utils import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_engine_greedy_is_token_identical_and_frees_blocks(smollm2_f64, method):
    from lab_utils import EngineConfig, LLMEngine, SamplingParams

    model, tok = smollm2_f64
    prompts = [_chat(tok, "Name three prime numbers."), _chat(tok, "Tell me about the Eiffel Tower."),
               tok.encode("To be, or not to be, that is the question:")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    base_eng = LLMEngine((model, tok), EngineConfig(block_size=4), device="cpu")
    base = base_eng.generate(prompts, params)
    eng = LLMEngine((model, tok), EngineConfig(block_size=4, speculative=SpecConfig(method, 3)), device="cpu")
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    eng.block_manager.check_all_free()
    st = eng.stats()
    # some guesses are kept (the shipped heads' acceptance on lab prompts is low, see their model cards)
    assert st["spec_num_verify_steps"] > 0 and st["spec_num_accepted"] > 0, st
