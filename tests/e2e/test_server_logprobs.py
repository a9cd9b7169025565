"""Logprobs and the sampler's processors through the official `openai` client: chat's logprobs / top_logprobs and
the completions' logprobs + echo in OpenAI's shapes, streamed and not, checked against a direct log_softmax of the
model's logits on the same tokens; logit_bias, penalties and min_tokens change what comes back; best_of and suffix
are a 400 naming the field."""
from __future__ import annotations

import pytest
import torch
from _server_utils import KEY, MODEL, UvicornThread, tiny_engine

from lab_utils.checks.teacher_forced import score
from lab_utils.server.app import create_app

openai = pytest.importorskip("openai")
PROMPT = [5, 17, 99, 3, 40, 41, 42, 43]
CHAT = [{"role": "user", "content": "Name a colour."}]
NO_EOS = {"ignore_eos": True, "return_token_ids": True}  # token ids in stream chunks (vLLM's return_token_ids)


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with UvicornThread(create_app(engine, MODEL, max_tokens_cap=64, api_key=KEY)) as srv:
        srv.engine = engine
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        yield srv


def _plain(obj):
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def _close(a, b, tol: float = 1e-5) -> bool:
    """Equal structures, numbers within `tol` (a streamed and a whole response of the same greedy request)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_completion_logprobs_with_echo_match_a_direct_log_softmax(server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, echo=True, extra_body=NO_EOS)
    chunks = list(server.client.completions.create(stream=True, **kw))
    out_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert len(out_ids) == 6
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if not c.choices or c.choices[0].logprobs is None:
            continue
        for key in streamed:
            streamed[key] += _plain(c.choices[0].logprobs)[key]
    whole = server.client.completions.create(**kw).choices[0]
    assert _close(_plain(whole.logprobs), streamed)  # the same tokens, the same numbers
    assert "".join(c.choices[0].text for c in chunks) == whole.text

    ids = PROMPT + out_ids
    ref = torch.log_softmax(score(server.engine.model, ids)[:-1], dim=-1)
    texts = [server.engine.tokenizer.decode([t]) for t in ids]
    lp = whole.logprobs
    assert lp.tokens == texts and whole.text.startswith(server.engine.tokenizer.decode(PROMPT))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has no logprob
    assert lp.token_logprobs[1:] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids[1:])], abs=1e-4)
    offsets = [0]
    for t in texts[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for i, top in enumerate(lp.top_logprobs[1:]):
        want = ref[i].topk(3)
        expected = {texts_of: float(v) for texts_of, v in
                    zip((server.engine.tokenizer.decode([int(j)]) for j in want.indices), want.values)}
        expected.setdefault(texts[i + 1], float(ref[i, ids[i + 1]]))  # the chosen token is always there
        assert top == pytest.approx(expected, abs=1e-4)


def test_chat_logprobs_streamed_and_not(server):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    whole = server.client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 5
    tok = server.engine.tokenizer
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely token
        assert entry.token == tok.decode([tok.convert_tokens_to_ids(_byte_level(entry.bytes))])  # exact bytes
    assert bytes(b for e in content for b in e.bytes).decode() == whole.message.content
    chunks = list(server.client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert _close([_plain(e) for e in streamed], [_plain(e) for e in content])
    plain = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def _byte_level(raw: list[int]) -> str:
    from lab_utils.server.logprobs import _byte_decoder

    to_char = {b: ch for ch, b in _byte_decoder().items()}
    return "".join(to_char[b] for b in raw)


def test_processors_change_what_comes_back(server):
    c = server.client.completions
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)

    def tokens(**kw):
        return c.create(**base, **{"extra_body": {"ignore_eos": True}} | kw).choices[0].logprobs.tokens

    plain = tokens()
    assert tokens(logit_bias={"7": 100}) == [server.engine.tokenizer.decode([7])] * 8
    assert len(set(tokens(presence_penalty=2.0))) > len(set(plain))
    assert len(set(tokens(frequency_penalty=2.0))) > len(set(plain))
    assert len(set(tokens(extra_body={"ignore_eos": True, "repetition_penalty": 2.0}))) > len(set(plain))
    eos = server.engine.tokenizer.eos_token_id
    end = {"logit_bias": {str(eos): 100}}
    assert len(c.create(**base, **end).choices[0].logprobs.tokens) == 1
    out = c.create(**base, **end, extra_body={"min_tokens": 4}).choices[0]
    assert len(out.logprobs.tokens) == 5 and out.finish_reason == "stop"


@pytest.mark.parametrize("kw,param", [
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": 10**400}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"), ({"logprobs": 6}, "logprobs"),
])
def test_out_of_range_values_are_a_400_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **kw)
    assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs" and "logprobs: true" in err.value.body["message"]
