"""Usage as OpenAI reports it, with the prompt tokens the prefix cache served
(`usage.prompt_tokens_details.cached_tokens`): 0 for a prefix the server has not seen, whole KV blocks of it
for a request that repeats a long prefix, on both endpoints, streamed (`include_usage`) and not, read through the
official `openai` client."""
from __future__ import annotations

import pytest
from _server_utils import KEY, MODEL, UvicornThread, tiny_engine

from lab_utils.server.app import create_app

openai = pytest.importorskip("openai")
BLOCK = 16


@pytest.fixture(scope="module")
def client():
    engine = tiny_engine(block_size=BLOCK)
    app = create_app(engine, MODEL, max_tokens_cap=16, api_key=KEY)
    with UvicornThread(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)


def _prefix(topic: str) -> str:
    """A long instruction prefix (well over a few KV blocks) that no other test sends."""
    return " ".join(f"Rule {i} about {topic}: answer in one short sentence." for i in range(12))


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_a_repeated_chat_prefix_reports_cached_tokens(client):
    system = {"role": "system", "content": _prefix("chat")}
    ask = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=[system, {"role": "user", "content": "Name a colour."}], **ask)
    second = client.chat.completions.create(messages=[system, {"role": "user", "content": "Name a city."}], **ask)
    assert _cached(first.usage) == 0, first.usage
    cached = _cached(second.usage)
    assert 0 < cached < second.usage.prompt_tokens and cached % BLOCK == 0, second.usage
    assert first.model == second.model == MODEL


def test_a_repeated_completion_prefix_reports_cached_tokens(client):
    prefix = _prefix("completions")
    ask = dict(model=MODEL, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt=prefix + " Question: one?", **ask)
    second = client.completions.create(prompt=prefix + " Question: two?", **ask)
    assert _cached(first.usage) == 0
    assert _cached(second.usage) > 0 and _cached(second.usage) % BLOCK == 0, second.usage
    assert _cached(second.usage) <= second.usage.prompt_tokens


def test_the_streamed_usage_chunk_reports_cached_tokens(client):
    prefix = _prefix("streams")
    ask = dict(model=MODEL, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True},
               extra_body={"ignore_eos": True})
    usages = []
    for question in ("one?", "two?"):
        chunks = list(client.completions.create(prompt=f"{prefix} Question: {question}", **ask))
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usages.append(chunks[-1].usage)
    assert _cached(usages[0]) == 0
    assert _cached(usages[1]) > 0 and _cached(usages[1]) % BLOCK == 0, usages[1]
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": prefix}], **ask))
    assert chat[-1].choices == [] and _cached(chat[-1].usage) % BLOCK == 0  # (the template's head: cached or not)
