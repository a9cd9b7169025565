"""Knowledge distillation: the KD loss's properties, the teacher targets, a short training run, the shipped draft."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab_utils.distill.loss import kd_loss, topk_kd_loss
from lab_utils.distill.student import (
    draft_config,
    init_student,
    num_params,
    pca_embedding,
)
from lab_utils.distill.teacher import generate_targets
from lab_utils.distill.train import evaluate, pad_batch, train
from lab_utils.paths import DATA_DIR

DRAFT = DATA_DIR / "models" / "smollm2-draft"


# ------------------------------------------------------------------------------------------------ the loss
def test_kd_loss_zero_when_student_equals_teacher():
    t = torch.randn(5, 30)
    for T in (0.5, 1.0, 4.0):
        assert kd_loss(t.clone(), t, T=T).abs().item() < 1e-6
    assert kd_loss(torch.randn(5, 30), t, T=1.0).item() > 0.01  # and positive otherwise


def test_kd_loss_is_t_squared_times_softened_kl():
    s, t = torch.randn(6, 40) * 2, torch.randn(6, 40) * 2
    for T in (1.0, 2.0, 5.0):
        kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean")
        assert torch.allclose(kd_loss(s, t, T=T), T * T * kl, rtol=1e-5)


def test_t_squared_keeps_the_loss_scale_at_high_temperature():
    # for large T, T^2 KL -> (1/2V) sum_i (d_i - mean d)^2 with d = teacher - student logits: a finite limit,
    # so the soft term neither vanishes nor explodes as T grows (without T^2 it would shrink like 1/T^2)
    s, t = torch.randn(3, 50), torch.randn(3, 50)
    d = t - s
    limit = ((d - d.mean(-1, keepdim=True)) ** 2).mean(-1).mean() / 2
    assert torch.allclose(kd_loss(s, t, T=200.0), limit, rtol=2e-2)
    assert kd_loss(s, t, T=200.0) / (200.0**2) < 1e-4 * limit


def test_kd_gradient_points_from_student_to_teacher():
    s, t = torch.randn(4, 20, requires_grad=True), torch.randn(4, 20)
    T = 3.0
    (g,) = torch.autograd.grad(kd_loss(s, t, T=T), s)
    expected = T * (F.softmax(s.detach() / T, -1) - F.softmax(t / T, -1)) / 4  # d(T^2 KL)/ds = T (q_T - p_T)
    assert torch.allclose(g, expected, atol=1e-6)
    with torch.no_grad():
        assert kd_loss(s - 0.5 * g, t, T=T) < kd_loss(s, t, T=T)  # a step against the gradient helps


def test_hard_label_mix_and_topk_match_the_dense_loss():
    s, t = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    labels = torch.randint(0, 16, (2, 3))
    ce = F.cross_entropy(s.flatten(0, 1), labels.flatten())
    assert torch.allclose(kd_loss(s, t, T=2.0, alpha=0.0, labels=labels), ce, rtol=1e-5)
    mixed = kd_loss(s, t, T=2.0, alpha=0.3, labels=labels)
    assert torch.allclose(mixed, 0.3 * kd_loss(s, t, T=2.0) + 0.7 * ce, rtol=1e-5)
    top = t.topk(16, -1)  # k = V: the top-k loss is the dense loss
    assert torch.allclose(topk_kd_loss(s, top.indices, top.values, T=2.0), kd_loss(s, t, T=2.0), rtol=1e-5)


@pytest.mark.parametrize("kw, field", [({"T": 0.0}, "T="), ({"alpha": 1.5}, "alpha="), ({"alpha": 0.5}, "labels")])
def test_kd_loss_rejects_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        kd_loss(torch.randn(2, 5), torch.randn(2, 5), **kw)


# ------------------------------------------------------------------------------------------ student, targets
def test_student_config_and_pca_init():
    cfg = draft_config()
    assert cfg["vocab_size"] == 49152 and cfg["head_dim"] == 64 and cfg["tie_word_embeddings"]
    E = torch.randn(100, 12)
    P = pca_embedding(E, 12)  # all directions: a rotation (and the RMS rescale, 1 here), so dot products survive
    assert torch.allclose(P @ P.T, E @ E.T, atol=1e-3)
    assert pca_embedding(E, 4).shape == (100, 4)
    with pytest.raises(ValueError, match="dim="):
        pca_embedding(E, 13)
    with pytest.raises(ValueError, match="heads="):
        draft_config(heads=3, kv_heads=2)


def test_left_padded_targets_equal_one_at_a_time(tiny64):
    model, _ = tiny64
    prompts = [(1, 5, 9), (1, 7, 300, 41, 12, 8), (3, 4)]
    together = generate_targets(model, prompts, 5, top_k=4, batch=3)
    alone = [generate_targets(model, [p], 5, top_k=4, batch=1)[0] for p in prompts]
    by_prompt = {tuple(r["ids"][: r["n_prompt"]].tolist()): r for r in together}
    for p, a in zip(prompts, alone):
        r = by_prompt[p]
        assert r["ids"].tolist() == a["ids"].tolist() and r["topk_idx"].tolist() == a["topk_idx"].tolist()
        assert len(r["topk_idx"]) == len(r["ids"]) - 1 and (r["topk_idx"][p.__len__() - 1:, 0] == r["ids"][len(p):]).all()


def test_short_training_run_lowers_the_loss_and_raises_agreement(smollm2):
    teacher, tok = smollm2
    torch.manual_seed(0)
    prompts = [tuple(tok(s).input_ids) for s in ("The capital of France is", "Once upon a time,",
                                                 "Water boils at", "The three primary colors are")]
    recs = generate_targets(teacher, prompts, 12, top_k=8, batch=4)
    student = init_student(draft_config(hidden=64, layers=1, heads=1, kv_heads=1, intermediate=128), teacher)
    before = evaluate(student, recs)
    log = train(student, recs, steps=40, batch=4, lr=1e-2, warmup=5, log_every=1)
    after = evaluate(student, recs)
    losses = [r["loss"] for r in log]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert after["agreement"] > before["agreement"] and after["kd_loss"] < before["kd_loss"]
    b = pad_batch(recs)
    assert b["gen"].sum().item() == sum(len(r["ids"]) - r["n_prompt"] for r in recs)


# ------------------------------------------------------------------------------------------ the shipped draft
def test_shipped_draft_loads_generates_and_agrees_with_its_teacher(smollm2):
    from lab_utils import LLMEngine, SamplingParams
    from lab_utils.models.loader import load_model

    assert (DRAFT / "config.json").exists() and (DRAFT / "model.safetensors").stat().st_size < 20e6
    draft, tok = load_model("smollm2-draft", device="cpu")
    teacher, _ = smollm2
    assert num_params(draft) < num_params(teacher) / 8
    untrained = init_student(draft_config(), None, seed=0).eval()
    sents = ["The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was designed by the company of",
             "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and",
             "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"]
    hits = {"draft": 0, "untrained": 0}
    total = 0
    with torch.no_grad():
        for s in sents:
            ids = torch.tensor([tok(s).input_ids])
            ref = teacher(ids).argmax(-1)
            hits["draft"] += (draft(ids).argmax(-1) == ref).sum().item()
            hits["untrained"] += (untrained(ids).argmax(-1) == ref).sum().item()
            total += ids.numel()
    assert hits["draft"] / total > 0.1 and hits["draft"] > 4 * max(hits["untrained"], 1), hits
    eng = LLMEngine("smollm2-draft", device="cpu")
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.finished
    eng.block_manager.check_all_free()


def test_prompt_mix_and_quote_prompts_stay_on_their_side_of_the_split():
    from lab_utils.distill.data import HELDOUT_PLAYS, make_prompts
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer
    from lab_utils.speculative.training.workloads import quote_prompts

    tok = load_tokenizer(model_folder("smollm2-135m"))
    ps = make_prompts(tok, 20, "train", mix=(0.5, 0.0, 0.0, 0.5))
    assert sorted({p.source for p in ps}) == ["chat", "quote"] and sum(p.source == "quote" for p in ps) == 10
    assert ps == make_prompts(tok, 20, "train", mix=(0.5, 0.0, 0.0, 0.5)), "prompts must be seeded"
    assert all("word for word" in p.text for p in ps if p.source == "quote")
    with pytest.raises(ValueError, match="mix"):
        make_prompts(tok, 4, "train", mix=(1.0, 0.0))
    # the benchmark's quote passages come from the held-out plays only, so the draft never trained on them
    from lab_utils.bench.workload import shakespeare_texts

    train_plays = [text for name, text in shakespeare_texts() if name not in HELDOUT_PLAYS]
    for prompt in quote_prompts(tok, 4):
        line = max(prompt.split("word for word:\n\n", 1)[1].split("\n")[1:-1], key=len).strip()
        assert len(line) > 10 and not any(line in text for text in train_plays), line
