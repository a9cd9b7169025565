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
    lab15.check_fan_out(fanout.fan_out, trials=1)
    assert "✔ check_fan_out" in capsys.readouterr().out
    assert "def fan_out(" in (learner_dir / "efficiency.py").read_text()


def reversed_order(engine, prompts, params):
    return fanout.fan_out(engine, prompts, params)[::-1]


def not_finished(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    return [o for o in engine.step() if o.request_id in ids]


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


def _raw_logprob(task, scores, threshold):
    return "small" if max(scores) >= threshold else "target"


@pytest.mark.parametrize("wrong, message", [
    (_wrong_side, "the other side"),
    (_reads_the_answer, "reads the answer"),
    (_raw_logprob, "raw log-probability"),
    (lambda task, scores, threshold: True, "'small' or 'target'"),
])
def test_wrong_routers_are_named(wrong, message):
    with pytest.raises(AssertionError, match=message):
        lab15.check_route(wrong)
