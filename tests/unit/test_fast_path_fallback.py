"""A fast path that fails mid-step falls back and leaves no trace: the step is re-run without it, and every token
equals an engine that never had it. The step's first attempt may already have written K/V for some layers, run
a graph's warm-up forwards or filled static buffers; none of it may change what any request computes next.

On a CPU the fast paths are stood in for as a GPU runs them minus the compiler (flex's eager reference, the graph
runner's padded static-buffer decode without capture), and the failure is injected after the failing layer wrote
its K/V, in a prefill step, a mixed step and a decode step. On CUDA, the float64 case the H200 run got wrong is
run in each configuration (eager, graphs without flex, every fast path on) against the CPU, so a failure names
the configuration."""
from __future__ import annotations

import warnings

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.engine.accel import flex_attention
from lab_utils.engine.accel.cuda_graphs import DecodeGraphRunner

# the H200 run's case: six prompts of 5..50 tokens through a 32-token budget: prefill, mixed, then decode steps
PROMPTS = [[100 + (7 * i + j) % 5000 for j in range(5 + 9 * i)] for i in range(6)]
# with each token's logprob: tiny-random mostly repeats its last token, so tokens alone would hide a perturbed
# attention; the logprobs (fp32 from fp64 logits) show it
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-5
CONFIG = dict(num_gpu_blocks=64, block_size=16, max_num_batched_tokens=32, max_model_len=256)


def _engine(device: str = "cpu", **config) -> LLMEngine:
    """Tiny-random drawn on the CPU and moved: a model drawn on CUDA has other weights (CUDA's generator differs),
    and tiny-random echoes its last token for a few steps whatever its weights, so such a comparison parts late."""
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float64)
    return LLMEngine((model.to(device), tok), EngineConfig(**CONFIG, **config), device=device)


class Outputs:
    """Each request's greedy tokens and their logprobs; equal to another run's where the tokens are identical and
    the logprobs agree within LOGPROB_TOL."""

    def __init__(self, outs) -> None:
        self.tokens = [o.token_ids for o in outs]
        self.logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]

    def __eq__(self, other) -> bool:
        return self.tokens == other.tokens and all(
            abs(a - b) <= LOGPROB_TOL for xs, ys in zip(self.logprobs, other.logprobs) for a, b in zip(xs, ys))

    def __repr__(self) -> str:
        return f"tokens {self.tokens}, logprobs {[[round(x, 6) for x in xs[:4]] for xs in self.logprobs]}"


def _generate(eng: LLMEngine) -> Outputs:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning: asserted through fast_path_errors instead
        out = Outputs(eng.generate(PROMPTS, PARAMS))
    eng.block_manager.check_all_free()
    return out


@pytest.fixture(scope="module")
def reference() -> Outputs:
    eng = _engine()
    eng.runner.cpu_decode_kernel = False
    return _generate(eng)


def _with_gpu_fast_paths(eng: LLMEngine) -> LLMEngine:
    """The fast paths a GPU engine starts with, on a CPU: flex (its eager reference) and the decode graph runner's
    padded static-buffer forward (no capture)."""
    r = eng.runner
    r.attention_backend, r.cpu_decode_kernel = "flex", False
    r.graphs = DecodeGraphRunner(r.model, r.cache, eng.block_size, eng.device, eng.config.max_num_seqs,
                                 eng.max_model_len, capture=False)
    return eng


class Injected(RuntimeError):
    pass


def _fail_once(eng: LLMEngine, monkeypatch, target, step: int, layer: int) -> None:
    """Make `target` ("flex" or "cuda_graphs") raise once, in engine step `step`, after layer `layer` of the
    failing forward wrote its K/V (a compile or capture that fails part-way)."""
    steps = {"n": 0}
    step_fn = eng.step

    def counted_step():
        steps["n"] += 1
        return step_fn()

    monkeypatch.setattr(eng, "step", counted_step)
    if target == "flex":
        call = flex_attention.FlexPagedAttention.__call__

        def flex(self, layer_idx, q, k, v):
            if steps["n"] == step and layer_idx == layer and not getattr(flex, "done", False):
                flex.done = True
                self.cache.write(layer_idx, self.meta.slot_mapping, k[0], v[0])
                raise Injected(f"flex failed in step {step}, layer {layer}")
            return call(self, layer_idx, q, k, v)

        monkeypatch.setattr(flex_attention.FlexPagedAttention, "__call__", flex)
    else:
        graphs = eng.runner.graphs
        forward = graphs._forward

        def graph_forward(e):
            out = forward(e)  # every layer wrote the step's K/V (and its padding rows' copies)
            if steps["n"] >= step and not getattr(graph_forward, "done", False):
                graph_forward.done = True
                raise Injected(f"capture failed in step {steps['n']}")
            return out

        monkeypatch.setattr(graphs, "_forward", graph_forward)


def test_the_gpu_fast_paths_stood_in_on_a_cpu_give_the_reference_tokens(reference):
    eng = _with_gpu_fast_paths(_engine())
    assert _generate(eng) == reference
    assert eng.runner.fast_path_errors == {} and eng.runner.attention_backend == "flex"


@pytest.mark.parametrize("target, step, layer", [
    ("flex", 1, 0),   # the first step, all prefill: the compile fails at its first call
    ("flex", 5, 1),   # a mixed step (decodes beside a 27-token chunk), after the first layer's attention ran
    ("cuda_graphs", 7, 0),  # the first decode-only step: the graph's forward ran, then the capture failed
])
def test_a_fast_path_that_fails_mid_step_leaves_no_trace(reference, monkeypatch, target, step, layer):
    eng = _with_gpu_fast_paths(_engine())
    _fail_once(eng, monkeypatch, target, step, layer)
    assert _generate(eng) == reference
    assert list(eng.runner.fast_path_errors) == [target] and "Injected" in eng.runner.fast_path_errors[target]
    on = {"flex": eng.runner.attention_backend == "flex", "cuda_graphs": eng.runner.graphs is not None}
    assert on == {name: name != target for name in on}  # that one off, the other still on


def test_a_first_attempt_that_leaves_a_trace_is_caught(reference, monkeypatch):
    """The negative control: a failing attempt that scribbles over K/V the re-run does not rewrite (the cached
    prefix of the step's sequences) changes the tokens, and the comparison above sees it."""
    eng = _with_gpu_fast_paths(_engine())
    call = flex_attention.FlexPagedAttention.__call__
    steps = {"n": 0}
    step_fn = eng.step
    monkeypatch.setattr(eng, "step", lambda: (steps.__setitem__("n", steps["n"] + 1), step_fn())[1])

    def scribbling_flex(self, layer_idx, q, k, v):
        if steps["n"] == 5 and not getattr(scribbling_flex, "done", False):
            scribbling_flex.done = True
            cached = self.meta.context_slots.flatten()
            cached = cached[~torch.isin(cached, self.meta.slot_mapping)]
            self.cache.k[layer_idx].index_fill_(0, cached, 0.0)  # this layer's keys of the cached prefix gone
            raise Injected("flex failed after corrupting the cached prefix")
        return call(self, layer_idx, q, k, v)

    monkeypatch.setattr(flex_attention.FlexPagedAttention, "__call__", scribbling_flex)
    assert _generate(eng) != reference


def test_a_failure_with_no_fast_path_to_blame_is_raised(monkeypatch):
    eng = _engine()
    eng.runner.cpu_decode_kernel = False

    def broken(*a, **k):
        raise Injected("the model itself is broken")

    monkeypatch.setattr(eng.runner.model, "hidden_states", broken)
    with pytest.raises(Injected, match="the model itself"):
        eng.generate(PROMPTS[:1], PARAMS)


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: needs CUDA")
@pytest.mark.parametrize("config", [dict(enforce_eager=True), dict(attention_backend="sdpa"), {}],
                         ids=["eager", "graphs-without-flex", "all-fast-paths"])
def test_cuda_float64_tokens_equal_the_cpu_in_each_configuration(reference, config):
    """The bisect of the H200 run's wrong float64 row: which configuration parts from the CPU. No fast path may
    fall back (a dtype a fast path cannot compile is never selected for it)."""
    eng = _engine("cuda", **config)
    assert _generate(eng) == reference
    assert eng.runner.fast_path_errors == {}
