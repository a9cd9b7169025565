"""`tool_choice: "required"` with parallel calls allowed always gives the client usable calls: the reply ends with
`finish_reason: "tool_calls"` and whole `tool_calls`, never a half-written array, for the trained model that
used to repeat one call until max_tokens and for a random model sampling freely."""
from __future__ import annotations

import json

import pytest
from _server_utils import KEY, MODEL, UvicornThread, tiny_engine

pytest.importorskip("xgrammar")
import jsonschema  # noqa: E402

from lab_utils import EngineConfig, LLMEngine  # noqa: E402
from lab_utils.server.app import create_app  # noqa: E402

openai = pytest.importorskip("openai")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(engine):
    return UvicornThread(create_app(engine, MODEL, max_tokens_cap=400, api_key=KEY))


@pytest.fixture(scope="module")
def trained(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512), device="cpu")
    with _client(engine) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [60, 200])
def test_the_trained_model_ends_with_one_whole_call(trained, stream, max_tokens):
    """SmolLM2-135M at temperature 0 repeated get_weather until max_tokens (60 and 200) under the unbounded
    array; with one tool the grammar admits one call."""
    kw = dict(model=MODEL, messages=MSG, tools=[WEATHER], tool_choice="required", temperature=0,
              max_tokens=max_tokens)
    if stream:
        finish, calls = None, []
        for chunk in trained.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                calls += choice.delta.tool_calls or []
    else:
        out = trained.chat.completions.create(**kw)
        finish, calls = out.choices[0].finish_reason, out.choices[0].message.tool_calls
        assert out.choices[0].message.content is None
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b", "c"]}}, "required": ["x"]}}} for name in ("f", "g", "h")]


@pytest.fixture(scope="module")
def random_model():
    with _client(tiny_engine()) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)


def test_a_random_model_sampling_freely_always_closes_the_array(random_model):
    """Random weights at temperature 1 over 12 seeds: each reply is 1 to 3 distinct calls in the tools' order."""
    for seed in range(12):
        out = random_model.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                                   temperature=1.0, seed=seed, max_tokens=400)
        choice = out.choices[0]
        names = [c.function.name for c in choice.message.tool_calls or []]
        assert choice.finish_reason == "tool_calls" and 1 <= len(names) <= len(TOOLS), (seed, choice)
        assert names == sorted(set(names), key="fgh".index), (seed, names)  # distinct, in the tools' order
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
