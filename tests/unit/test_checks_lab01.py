"""Lab 01's checker accepts a correct admit/retire step and rejects each common mistake with a useful message."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab01
from lab_utils.checks.lab01 import ToyRequest


def good(running, waiting, max_num_seqs):
    finished = [r for r in running if r.remaining == 0]
    running = [r for r in running if r.remaining > 0]
    free = max_num_seqs - len(running)
    return running + waiting[:free], waiting[free:], finished


def mutating_good(running, waiting, max_num_seqs):
    """Correct, written with in-place list edits (the checker passes copies, so this is fine)."""
    finished = [r for r in running if r.remaining == 0]
    for r in finished:
        running.remove(r)
    while waiting and len(running) < max_num_seqs:
        running.append(waiting.pop(0))
    return running, waiting, finished


def test_accepts_correct(capsys):
    lab01.check_admit_retire(good, seed=0)
    lab01.check_admit_retire(mutating_good)
    assert "check_admit_retire passed" in capsys.readouterr().out


def _admit_before_retire(running, waiting, B):
    free = B - len(running)
    still = [r for r in running if r.remaining > 0]
    return still + waiting[:free], waiting[free:], [r for r in running if r.remaining == 0]


def _never_retires(running, waiting, B):
    free = B - len(running)
    return running + waiting[:free], waiting[free:], []


def _lifo(running, waiting, B):
    still = [r for r in running if r.remaining > 0]
    free = B - len(still)
    took = waiting[::-1][:free]
    return still + took, [w for w in waiting if w not in took], [r for r in running if r.remaining == 0]


def _overfills(running, waiting, B):
    still = [r for r in running if r.remaining > 0]
    return still + waiting[:B], waiting[B:], [r for r in running if r.remaining == 0]


def _drops_waiting(running, waiting, B):
    r, _, f = good(running, waiting, B)
    return r, [], f


def _no_finished_list(running, waiting, B):
    r, w, _ = good(running, waiting, B)
    return r, w, []


@pytest.mark.parametrize("fn, message", [
    (lab01.static_admit_retire, "must be refilled this step"),
    (_admit_before_retire, "counted before retiring"),
    (_never_retires, "still in the batch"),
    (_lifo, "arrival order"),
    (_overfills, "max_num_seqs"),
    (_drops_waiting, "disappeared"),
    (_no_finished_list, "not returned in `finished`"),
    (lambda running, waiting, B: [running, waiting, []], "return a tuple"),
])
def test_rejects_mistakes_with_a_useful_message(fn, message):
    with pytest.raises(AssertionError, match=message):
        lab01.check_admit_retire(fn, seed=0)


def test_not_implemented_propagates():
    def todo(running, waiting, B):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab01.check_admit_retire(todo)


def test_toy_simulation_counts_the_static_waste():
    lens = [10, 20, 30, 100]  # the quiz's batch: 160 useful slot-steps of 400
    static = lab01.simulate(lab01.static_admit_retire, lens, 4)
    assert static.steps == 100 and static.utilization(4) == pytest.approx(0.4)
    # 8 requests, 2 slots: static waits for the longer of each pair, continuous refills at once
    lens = [1, 9, 1, 9, 1, 9, 1, 9]
    s = lab01.simulate(lab01.static_admit_retire, lens, 2)
    c = lab01.simulate(lab01.reference_admit_retire, lens, 2)
    assert s.steps == 36 and c.steps == 21
    assert max(c.finish_step.values()) == 21 and c.finish_step["0"] == 1  # a short request leaves after its step
    assert all(len(b) <= 2 for b in c.batch)


# -- the engine part: schedule_continuous ----------------------------------------------------------------------
def _lifo(self):
    """Admits the newest waiting request first: breaks first come, first served."""
    from lab_utils.engine.request import Status
    from lab_utils.engine.scheduler import SchedulerOutput

    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        self.waiting.rotate(1)  # the last arrival jumps to the head
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or not self.can_start(req, n):
            self.waiting.rotate(-1)
            break
        n = self.start(req, n)
        out.scheduled.append((req, n))
        budget -= n
    if not out.scheduled:
        for req in list(self.running):
            if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
                out.scheduled.append((req, 1))
    return out


def _decodes_and_prefills(self):
    """Mixes the admitted prompts and the decodes in one step: not prefill-first."""
    from lab_utils.engine.request import Status
    from lab_utils.engine.scheduler import SchedulerOutput

    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    for req in list(self.running):
        if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
            out.scheduled.append((req, 1))
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        req = self.waiting[0]
        n = req.num_tokens - req.num_computed_tokens
        if not self.can_start(req, n):
            break
        out.scheduled.append((req, self.start(req, n)))
    return out


@pytest.mark.parametrize("wrong", [_lifo, _decodes_and_prefills])
def test_check_schedule_continuous_rejects_wrong_steps(wrong, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="schedule_continuous"):
        lab01.check_schedule_continuous(wrong)
    assert not (tmp_path / "scheduler.py").exists(), "a part that fails its check must not be saved"


def test_check_schedule_continuous_accepts_and_saves_the_reference(tmp_path, monkeypatch):
    from lab_utils.engine.scheduler import Scheduler

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    lab01.check_schedule_continuous(Scheduler.schedule_continuous, cases=50)
    assert "def schedule_continuous(" in (tmp_path / "scheduler.py").read_text()


def _ignores_ignore_eos(req, token, eos_ids, max_model_len):
    if token in eos_ids or token in req.params.stop_token_ids:
        return "stop"
    return "length" if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len else None


def test_check_stop_reason_rejects_a_wrong_rule_and_accepts_the_reference(tmp_path, monkeypatch):
    from lab_utils.engine.engine import stop_reason

    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="ignore_eos"):
        lab01.check_stop_reason(_ignores_ignore_eos)
    lab01.check_stop_reason(stop_reason, cases=50)
    assert "def stop_reason(" in (tmp_path / "engine.py").read_text()
