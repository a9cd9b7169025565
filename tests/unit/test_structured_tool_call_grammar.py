"""`tool_choice: "required"` with parallel calls: the grammar admits 1 to len(tools) calls, each tool at most once
and in the order `tools` lists them, so a model that would repeat a call has to close the array; a reply cut by
max_tokens keeps the calls written whole."""
from __future__ import annotations

import json

import pytest

from lab_utils.server.tools import Tool, chat_reply, complete_calls, distinct_calls_grammar, structured_output

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

WEATHER = Tool(function={"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
TIME = Tool(function={"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}})
NOARGS = Tool(function={"name": "ping"})
TOOLS = [WEATHER, TIME, NOARGS]


def _call(name: str, **params) -> dict:
    return {"name": name, "parameters": params}


def _text(*calls) -> str:
    return json.dumps(list(calls), separators=(",", ":"))


@pytest.fixture(scope="module")
def grammar():
    return xgr.Grammar.from_ebnf(distinct_calls_grammar(TOOLS))


def _accepts(grammar, text: str) -> bool:
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("calls", [
    [_call("get_weather", city="Paris")], [_call("get_time", tz="utc")], [_call("ping")],
    [_call("get_weather", city="Paris"), _call("ping")],
    [_call("get_weather", city="Oslo"), _call("get_time", tz="cet"), _call("ping")]])
def test_each_subset_of_the_tools_in_their_order_is_admitted(grammar, calls):
    assert _accepts(grammar, _text(*calls))


@pytest.mark.parametrize("calls,why", [
    ([], "no call"),
    ([_call("get_weather", city="Paris"), _call("get_weather", city="Paris")], "a repeated call"),
    ([_call("get_weather", city="Paris"), _call("get_weather", city="Rome")], "a tool called twice"),
    ([_call("ping"), _call("get_weather", city="Paris")], "out of the tools' order"),
    ([_call("get_time", tz="pst")], "parameters outside the tool's schema"),
    ([_call("launch")], "an unknown tool")])
def test_what_is_not_a_bounded_distinct_call_list_is_refused(grammar, calls, why):
    assert not _accepts(grammar, _text(*calls)), why


def test_one_tool_admits_exactly_one_call():
    one = xgr.Grammar.from_ebnf(distinct_calls_grammar([WEATHER]))
    assert _accepts(one, _text(_call("get_weather", city="Paris")))
    assert not _accepts(one, _text(_call("get_weather", city="Paris"), _call("get_weather", city="Paris")))


def test_required_uses_the_grammar_unless_parallel_calls_are_off():
    assert set(structured_output(None, TOOLS, "required")) == {"grammar"}
    single = structured_output(None, TOOLS, "required", parallel_tool_calls=False)
    assert single["json"]["minItems"] == single["json"]["maxItems"] == 1


def test_a_reply_cut_by_max_tokens_keeps_its_whole_calls():
    cut = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"tz":"u'
    assert complete_calls(cut) == [_call("get_weather", city="Paris")]
    message, finish = chat_reply(cut, "required", TOOLS, "length")
    assert finish == "length" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    message, finish = chat_reply('[{"name":"get_wea', "required", TOOLS, "length")  # nothing whole: the text
    assert finish == "length" and message == {"role": "assistant", "content": '[{"name":"get_wea'}
