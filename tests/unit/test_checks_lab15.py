"""Lab 15's checks: the reference passes; the usual mistakes are named (negative controls)."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab15
from lab_utils.efficiency import fanout


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    return tmp_path / "my_engine"


def test_reference_fan_out_passes_and_is_saved(capsys, learner_dir):
    lab15.check_fan_out(fanout.fan_out, trials=3)  # the notebook's three: one chunked, two with a stop token
    assert "✔ check_fan_out" in capsys.readouterr().out
    assert "def fan_out(" in (learner_dir / "efficiency.py").read_text()


def reversed_order(engine, prompts, params):
    return fanout.fan_out(engine, prompts, params)[::-1]


def not_finished(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    return [o for o in engine.step() if o.request_id in ids]


def first_to_completion(engine, prompts, params):  # the first finished before the others are sent
    first = engine.generate([prompts[0]], params)
    return first + engine.generate(list(prompts[1:]), params)


def step_once(engine, prompts, params):  # one step after the first: enough only when its prompt fits a step
    first = engine.add_request(prompts[0], params)
    done = {o.request_id: o for o in engine.step() if o.finished}
    ids = [first] + [engine.add_request(p, params) for p in prompts[1:]]
    return fanout.run_until_done(engine, ids, done)


def finish_order(engine, prompts, params):  # the outputs as they finish
    first = engine.add_request(prompts[0], params)
    done = []
    while not any(o.request_id == first for o in engine.step()):
        pass
    ids = [first] + [engine.add_request(p, params) for p in prompts[1:]]
    while len(done) < len(ids):
        done += [o for o in engine.step() if o.finished and o.request_id in ids]
    return done


@pytest.mark.parametrize("wrong, message, trials", [
    (first_to_completion, "ran in no engine step with another sub-task", 1),
    (finish_order, "a later sub-task finished first", 1),
    (step_once, "its prompt can take several steps of 48 tokens", 2),
])
def test_fan_outs_that_break_the_contract_in_a_corner_are_named(wrong, message, trials):
    with pytest.raises(AssertionError) as err:
        lab15.check_fan_out(wrong, trials=trials)
    msg = str(err.value)
    assert "efficiency.fan_out (lab 15, my_engine/efficiency.py)" in msg and message in msg, msg


def test_a_fan_out_that_steps_once_passes_when_every_prompt_fits_a_step():
    lab15.check_fan_out(step_once, trials=1)  # the first trial's prompts fit the budget: stepping once is enough


@pytest.mark.parametrize("wrong, message", [
    (fanout.one_by_one, "ran one after\\s+another"),                     # no batching
    (fanout.all_at_once, "computed the shared prefix about"),            # the prefix once a sub-task
    (reversed_order, "in the order\\s+of the prompts"),
    (not_finished, "not finished|one RequestOutput per prompt"),
])
def test_wrong_fan_outs_are_named(wrong, message):
    with pytest.raises(AssertionError, match=message):
        lab15.check_fan_out(wrong, trials=1)


def test_not_implemented_passes_through():
    def stub(engine, prompts, params):
        raise NotImplementedError("write me")

    with pytest.raises(NotImplementedError):
        lab15.check_fan_out(stub, trials=1)


def test_prompt_usage_reference_passes_and_cached_as_computed_is_named(capsys):
    lab15.check_prompt_usage(fanout.prompt_usage)
    assert "✔ check_prompt_usage" in capsys.readouterr().out

    def cached_as_computed(outputs):
        usage = fanout.prompt_usage(outputs)
        return dict(usage, computed_tokens=usage["prompt_tokens"])

    with pytest.raises(AssertionError, match="cached ones counted as computed"):
        lab15.check_prompt_usage(cached_as_computed)


def test_route_reference_passes_and_is_saved(capsys, learner_dir):
    from lab_utils.efficiency import routing

    lab15.check_route(routing.route)
    assert "✔ check_route" in capsys.readouterr().out
    assert "def route(" in (learner_dir / "efficiency.py").read_text()


def _wrong_side(task, scores, threshold):
    from lab_utils.efficiency.routing import confidence

    return "target" if confidence(scores) >= threshold else "small"


def _reads_the_answer(task, scores, threshold):
    return "small" if max(range(len(scores)), key=scores.__getitem__) == task.answer else "target"


def _confidence(scores):
    from lab_utils.efficiency.routing import confidence

    return confidence(scores)


def _raw_logprob(task, scores, threshold):
    return "small" if max(scores) >= threshold else "target"


@pytest.mark.parametrize("wrong, message", [
    (_wrong_side, "the other side"),
    (_reads_the_answer, "reads the answer"),
    (_raw_logprob, "raw log-probability"),
    (lambda task, scores, threshold: True, "'small' or 'target'"),
    (lambda task, scores, threshold: "small" if _confidence(scores) > threshold else "target", "not >"),
])
def test_wrong_routers_are_named(wrong, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab15.check_route(wrong)
    assert "efficiency.route (lab 15, my_engine/efficiency.py)" in str(err.value)
