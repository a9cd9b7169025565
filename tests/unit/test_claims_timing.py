"""lab_utils.checks.timing: interleaved rounds, per-round ratios, and a verdict that can say 'not judged'."""
from __future__ import annotations

import math

import pytest

from lab_utils.checks.claims import report
from lab_utils.checks.timing import interleave, judge, judge_error, ratios, verdict


def test_interleave_alternates_the_sides():
    order = []
    out = interleave({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}, 3)
    assert order == ["a", "b"] * 3 and out == {"a": [1, 1, 1], "b": [2, 2, 2]}
    with pytest.raises(ValueError):
        interleave({"a": lambda: 1}, 0)


def test_a_round_with_zero_on_both_sides_is_dropped():
    assert ratios([0.0, 2.0, 1.0], [0.0, 1.0, 0.0]) == [2.0, math.inf]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])


@pytest.mark.parametrize("rounds, bar, strict, want", [
    ([3.1, 2.8, 3.4], 2.0, False, True),      # every round clears it
    ([1.1, 1.3, 1.2], 2.0, False, False),     # no round does
    ([2.1, 1.9, 2.05], 2.0, False, True),     # straddle, rounds agree: the median decides
    ([1.95, 2.05, 1.9], 2.0, False, False),
    ([3.3, 1.2, 2.9], 2.0, False, None),      # straddle, rounds disagree: too busy to tell
    ([], 1.0, True, None),                    # nothing measured (0 vs 0 in every round)
    ([1.0, 1.0], 1.0, True, False),           # equal is not higher
    ([math.inf, 2.0], 1.0, True, True),
])
def test_verdict(rounds, bar, strict, want):
    assert verdict(rounds, bar, strict) is want


def test_a_claim_not_judged_says_why_and_how_to_rerun_and_raises_nothing(capsys):
    claim = judge("A beats B", [3.3, 1.2, 2.9], 2.0, "rerun cell 7")
    assert claim[1] is None and "NOT JUDGED" in claim[0] and "rerun cell 7" in claim[0]
    report([claim, ("a plain claim", True)])
    assert "NOT JUDGED  A beats B" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="1 of 2"):
        report([claim, ("a plain claim", False)], show=False)


@pytest.mark.parametrize("errors, spreads, want", [
    ({"TTFT": 0.10, "TPOT": 0.20}, {"TTFT": 0.90, "TPOT": 0.05}, True),    # within the bound: noise is no excuse
    ({"TTFT": 0.60, "TPOT": 0.20}, {"TTFT": 0.05, "TPOT": 0.05}, False),   # repeats agree, the prediction is off
    ({"TTFT": 0.60, "TPOT": 0.20}, {"TTFT": 0.80, "TPOT": 0.05}, None),    # repeats disagree beyond the bound
    ({"TTFT": 0.60, "TPOT": 0.50}, {"TTFT": 0.80, "TPOT": 0.05}, False),   # one metric fails on steady repeats
])
def test_judge_error_says_not_judged_only_when_the_measurement_is_too_noisy(errors, spreads, want):
    text, ok = judge_error("the model predicts the run", errors, spreads, 0.35, "rerun the calibration cell")
    assert ok is want
    assert ("NOT JUDGED" in text and "rerun the calibration cell" in text and "TTFT 80%" in text) == (want is None)


# ------------------------------------------------------------------------------------------------ device costs
def test_step_costs_fit_recovers_both_profiles():
    from lab_utils.checks.timing import StepCosts
    from tests.unit import step_profiles

    tokens = [1, 4, 9, 32, 64, 128, 256, 512] * 3
    decode = [n <= 32 for n in tokens]
    cpu = StepCosts.fit([step_profiles.log(tokens, "cpu", decode=decode)])
    for line in (cpu.prompt, cpu.decode):
        assert line.fixed_s < 6e-3 and line.per_token_s == pytest.approx(4e-4, rel=0.1)  # 3 % jitter on 0.2 s
    flat = StepCosts.fit([step_profiles.log(tokens, "launch", decode=decode)])
    assert flat.cost(512) / flat.cost(64) < 1.05 and flat.cost(32, True) / flat.cost(1, True) < 1.05
    assert flat.prompt.fixed_s == pytest.approx(0.03, rel=0.03)
    gpu = StepCosts.fit([step_profiles.log(tokens, "gpu", decode=decode)])  # two kinds, two costs
    assert gpu.cost(64) == pytest.approx(0.1, rel=0.05) and gpu.cost(8, True) == pytest.approx(0.005, rel=0.1)
    assert "decode-only step" in gpu.describe() and "(fitted on 24 steps of up to 512 tokens)" in gpu.describe()
    only_prompts = StepCosts.fit([step_profiles.log([n for n in tokens if n > 1], "cpu")])  # a kind the logs
    # lack takes the other's (a one-token prompt chunk reads as a decode row: not among these)
    assert only_prompts.decode == only_prompts.prompt
    with pytest.raises(ValueError, match="at least two sizes"):
        StepCosts.fit([step_profiles.log([8, 8, 8], "cpu")])


def test_device_condition_judges_only_a_prediction_that_clears_the_bar_with_a_margin():
    from lab_utils.checks.timing import DEVICE_MARGIN, Line, StepCosts, device_condition

    costs = StepCosts(Line(0.03, 0.0), Line(0.03, 0.0), 10, 512)
    assert device_condition(("x >= 2x", False), 2 * DEVICE_MARGIN, 2.0, costs, "growth") == ("x >= 2x", False)
    text, ok = device_condition(("x >= 2x", False), 1.9 * DEVICE_MARGIN, 2.0, costs, "a cost that grows")
    assert ok is None and "NOT JUDGED: on this device a step with prompt tokens costs 30.00 ms" in text and "a cost that grows" in text


def test_launch_bound_steps_make_a_real_engines_step_cost_flat_and_lab01s_claim_says_so():
    """The profile on the real engine: static and continuous batching of one workload under it, the step logs
    fitted flat, and lab 01's >= 2x claim NOT JUDGED with the prediction (continuous gains only fewer steps),
    never a FAIL; outside the block the engine's steps are its own again."""
    from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
    from lab_utils.checks import lab01
    from lab_utils.checks.timing import StepCosts, launch_bound_steps

    model_tok = load_model("tiny-random", device="cpu")
    prompts = [[100 + i + j for j in range(4 + i % 5)] for i in range(6)]
    lens = [2, 5, 3, 4, 2, 5]

    def run(sched: str) -> list[dict]:
        eng = LLMEngine(model_tok, EngineConfig(scheduler=sched, max_num_seqs=3, num_gpu_blocks=64), device="cpu")
        for p, n in zip(prompts, lens):
            eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        return eng.step_log

    # the floor: well above what a step costs on this machine now (a loaded CPU's steps are far slower)
    floor = max(0.05, 4 * max(s["end"] - s["start"] for s in run("static")))
    logs, seconds = {}, {}
    with launch_bound_steps(floor):
        for sched in ("static", "continuous"):
            logs[sched] = run(sched)
            seconds[sched] = logs[sched][-1]["end"] - logs[sched][0]["start"]
    costs = StepCosts.fit(logs.values())
    assert all(s["end"] - s["start"] >= floor for log in logs.values() for s in log)
    for decode_only in (False, True):
        cheapest, dearest = costs.cost(1, decode_only), costs.cost(costs.max_tokens, decode_only)
        assert cheapest >= 0.9 * floor and dearest < 1.5 * cheapest, costs.describe()
    r = dict(throughput_rounds=[seconds["static"] / seconds["continuous"]], static_steps=len(logs["static"]),
             continuous_steps=len(logs["continuous"]), mismatch={}, static_eq_cont=True,
             calls={name: 1 for name in lab01.CONTINUOUS_RUN_PARTS}, step_logs=logs)
    text, ok = lab01.claims(r)[0]
    assert ok is None and "predicts only" in text, text
    eng = LLMEngine(model_tok, EngineConfig(num_gpu_blocks=64), device="cpu")  # the profile is gone
    eng.generate([prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert min(s["end"] - s["start"] for s in eng.step_log) < floor
    with pytest.raises(ValueError, match="must be > 0"):
        with launch_bound_steps(0):
            pass


def test_the_step_floor_env_var_puts_a_whole_process_under_the_launch_bound_profile():
    import os
    import subprocess
    import sys

    code = ("import lab_utils.checks\n"
            "from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model\n"
            "eng = LLMEngine(load_model('tiny-random', device='cpu'), EngineConfig(num_gpu_blocks=16), device='cpu')\n"
            "eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "print(min(s['end'] - s['start'] for s in eng.step_log))")
    env = dict(os.environ, LAB_STEP_FLOOR_S="0.3")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) >= 0.3
    r = subprocess.run([sys.executable, "-c", "import lab_utils.checks"], env=dict(env, LAB_STEP_FLOOR_S="fast"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "LAB_STEP_FLOOR_S='fast' is not a number of seconds" in r.stderr
