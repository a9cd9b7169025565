"""Lab 03's check accepts the engine's token-budget step and rejects each common mistake with a named message."""
from __future__ import annotations

import pytest

from lab_utils.course import learner_parts
from lab_utils.checks import lab03
from lab_utils.engine.request import Status
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


def _step(self, running_first=True, retire=True, chunk=True, prefills_continue=True, budget_cap=True,
          admit_after_preempt=False):
    """A token-budget step with switches for the mistakes learners make (all defaults: correct)."""
    out = SchedulerOutput()
    if retire:
        self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens

    def run_running():
        nonlocal budget
        for req in list(self.running):
            if budget <= 0 and budget_cap:
                break
            if req.status is not Status.RUNNING:
                continue
            left = req.num_tokens - req.num_computed_tokens
            if not prefills_continue and req.is_prefill and req.num_computed_tokens > 0:
                left = 1
            n = min(left, budget) if budget_cap else left
            if self.make_room(req, req.num_computed_tokens + n, out):
                out.scheduled.append((req, n))
                budget -= n

    def admit():
        nonlocal budget
        while self.waiting and (budget > 0 or not budget_cap) and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget) if budget_cap else left
            if n < left and not chunk:
                break
            if not self.can_start(req, n):
                break
            out.scheduled.append((req, self.start(req, n)))
            budget -= out.scheduled[-1][1]

    if not running_first:
        started = len(self.running)
        admit()
        keep, self.running = self.running, self.running[:started]
        run_running()
        self.running = self.running + [r for r in keep[started:] if r not in self.running]
    else:
        run_running()
        if not out.preempted or admit_after_preempt:
            admit()
    return out


def good(self):
    return _step(self)


def test_accepts_the_reference_and_a_correct_step(capsys):
    lab03.check_schedule_token_budget(Scheduler.schedule_token_budget, submit=False)
    lab03.check_schedule_token_budget(good, trials=60, seed=3, submit=False)
    assert "random cases agree with the reference" in capsys.readouterr().out


def test_submit_makes_it_the_engines_part(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    try:
        lab03.check_schedule_token_budget(good, trials=20)
        assert learner_parts.parts(upto="03", quiet=True).is_learners(lab03.PART)
        assert "def schedule_token_budget(" in (tmp_path / "scheduler.py").read_text()
    finally:
        learner_parts.forget()


@pytest.mark.parametrize("bad, message", [
    (lambda self: _step(self, running_first=False), "running requests come first"),
    (lambda self: _step(self, budget_cap=False), "the budget \\(max_num_batched_tokens\\) is"),
    (lambda self: _step(self, retire=False), "retire finished requests"),
    (lambda self: _step(self, chunk=False), "chunked to fit"),
    (lambda self: _step(self, prefills_continue=False), "takes its next chunk"),
    (lambda self: _step(self, admit_after_preempt=True), "admit no new request"),
    (lambda self: None, "return the step as a SchedulerOutput"),
])
def test_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab03.check_schedule_token_budget(bad, submit=False)


def test_wrong_signature_is_named():
    with pytest.raises(TypeError, match="takes 2 parameter"):
        lab03.check_schedule_token_budget(lambda self, budget: None, submit=False)


def test_not_implemented_propagates():
    def todo(self):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab03.check_schedule_token_budget(todo, submit=False)


# --- negative controls for the lab's closing claims ------------------------------------------------------------
def _run() -> dict:
    rows = [dict(scheduler=s, budget=b, max_itl_ms=ms) for b in (32, 64, 128)
            for s, ms in (("continuous", 90.0), ("token_budget", 30.0))]
    toks = {"0": [5, 6, 7], "1": [8, 9]}
    return dict(rows=rows, chunked_budgets=[32, 64, 128], runs_complete=[True] * 12,
                run_tokens=[dict(toks) for _ in range(12)], whole_prompt_tokens=toks,
                calls={lab03.PART: 96})


def test_claims_pass_on_a_good_run(capsys):
    lab03.assert_claims(_run())
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    (lambda r: r["rows"][2].update(max_itl_ms=20.0), "shortens the worst stall"),  # prefill-first better at 64
    (lambda r: r.update(chunked_budgets=[]), "shortens the worst stall"),
    (lambda r: r["runs_complete"].__setitem__(3, False), "every request finished"),
    (lambda r: r["run_tokens"][5].update({"1": [8, 10]}), "greedy outputs unchanged"),
    (lambda r: r.update(run_tokens=[]), "greedy outputs unchanged"),
    (lambda r: r.update(calls={lab03.PART: 0}), "never called: scheduler.schedule_token_budget"),  # registered, never run
    (lambda r: r.update(calls={}), "never called: scheduler.schedule_token_budget"),
])
def test_each_claim_can_fail(change, message):
    r = _run()
    change(r)
    with pytest.raises(AssertionError, match=message):
        lab03.assert_claims(r, show=False)


def test_claims_name_a_missing_measurement():
    r = _run()
    del r["whole_prompt_tokens"]
    with pytest.raises(KeyError, match="whole_prompt_tokens"):
        lab03.claims(r)


def test_a_parting_counts_only_at_a_near_tie_of_the_model():
    import torch

    from lab_utils.checks.teacher_forced import score
    from lab_utils.models.loader import load_model

    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    prompt = [5, 17, 99, 3]
    logits = score(model, prompt)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    r = _run()
    r.update(model=model, prompts={"0": prompt, "1": prompt}, whole_prompt_tokens={"0": [best, 7], "1": [best]},
             run_tokens=[{"0": [best, 7], "1": [best]}] * 11 + [{"0": [worst, 7], "1": [best]}])
    with pytest.raises(AssertionError, match="greedy outputs unchanged"):   # parted where the model was sure
        lab03.assert_claims(r, show=False)
    twin = model.lm_head.weight.detach().clone()
    twin[worst] = twin[best]                                                 # now an exact tie: allowed
    with torch.no_grad():
        model.lm_head.weight.copy_(twin)
    lab03.assert_claims(r, show=False)
