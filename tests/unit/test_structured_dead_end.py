"""A grammar that leaves no token is the request's own problem: refused when the schema shows it, else ended
alone with `DEAD_END`; the sampler never sees a row where every token is masked, and nobody else notices."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from lab_utils import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from lab_utils.structured.hook import DEAD_END, GrammarCompiler  # noqa: E402
from lab_utils.structured.schema import prepare_schema  # noqa: E402
from lab_utils.structured.params import StructuredOutputParams  # noqa: E402

PROMPTS = [[101, 202, 303, 404], [505, 606, 707]]


def _engine(tiny64):
    return LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=200), device="cpu")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {}, "additionalProperties": False, "required": ["a"]},
    {"type": "object", "properties": {"x": {"type": "object", "additionalProperties": False, "required": ["y"]}},
     "required": ["x"]},
])
def test_schema_that_admits_nothing_is_refused_before_any_step(tiny64, schema):
    eng = _engine(tiny64)
    with pytest.raises(ValueError, match="allows no output|can never be met"):
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_output={"json": schema}))
    assert not eng.scheduler.has_work() and not eng.structured.matchers


def test_satisfiable_schemas_are_not_refused():
    prepare_schema({"type": "object", "required": ["a"]})  # any value for "a"
    prepare_schema({"type": "object", "properties": {"a": {}}, "additionalProperties": False, "required": ["a"]})
    prepare_schema({"anyOf": [{"additionalProperties": False, "required": ["a"]}, {}]})  # the second branch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_token_ends_only_its_request(tiny64, temperature):
    """A mask step that forbids every token (as a grammar that dead-ends half-way does): the constrained request
    ends with DEAD_END, the sampler gets a finite row (no NaN, no step failure), the plain request is unchanged."""
    eng = _engine(tiny64)
    eng.structured.use(mask_fn=lambda logits, bitmask: torch.full_like(logits, float("-inf")))
    plain = SamplingParams(max_tokens=6, temperature=temperature, seed=1, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=temperature, seed=2, structured_output={"json_object": True})
    outs = eng.generate(PROMPTS, [plain, bad])
    assert outs[1].finish_reason == DEAD_END and outs[1].text == ""
    ref = _engine(tiny64).generate(PROMPTS[:1], [plain])[0]
    assert outs[0].token_ids == ref.token_ids and outs[0].finish_reason == "length"
    eng.block_manager.check_all_free()
    assert not eng.structured.matchers and not eng.structured.dead_ends


def test_compile_cache_is_bounded_and_remembers_refusals(tiny64):
    model, tok = tiny64
    gc = GrammarCompiler(tok, model.config.vocab_size, [tok.eos_token_id or 0], max_entries=3)
    for i in range(5):
        gc.compile(StructuredOutputParams(regex=f"a{{{i + 1}}}"))
    assert len(gc.cache) == 3 and gc.cached(StructuredOutputParams(regex="a{5}"))
    assert not gc.cached(StructuredOutputParams(regex="a{1}"))
    bad = StructuredOutputParams(json={"$ref": "#"})
    for _ in range(2):
        with pytest.raises(ValueError, match="allows no output|can never be met"):
            gc.compile(bad)
    assert gc.cached(bad)


def test_step_log_is_bounded(tiny64):
    eng = _engine(tiny64)
    assert eng.structured.step_log.maxlen is not None
