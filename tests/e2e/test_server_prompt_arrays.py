"""/v1/completions takes OpenAI's four prompt shapes through the official `openai` client: a string, a list of
token ids, a list of strings and a list of token-id lists. Each prompt is one choice, `index` its place in the
list, and the usage is the sum over the prompts, streamed or not; a bad prompt in a list is a 400 naming it, and
nothing it sent stays queued."""
from __future__ import annotations

import time

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app
from lab_utils.server.schemas import MAX_PROMPTS

openai = pytest.importorskip("openai")
MAX_TOKENS = 3
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with UvicornThread(create_app(engine, MODEL, max_tokens_cap=2000, api_key=KEY)) as srv:
        srv.engine = engine
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
        yield srv


def _ids(server, text: str) -> list[int]:
    return server.engine.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("shape", ["strings", "id_lists"])
def test_one_choice_per_prompt_in_order_with_the_usage_summed(server, shape):
    texts = ["The capital of France", "one two three four five", "x"]
    prompts = texts if shape == "strings" else [_ids(server, t) for t in texts]
    r = server.client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, text in zip(r.choices, texts):  # each choice answers its own prompt
        assert choice.model_extra["prompt_token_ids"] == _ids(server, text)
        assert len(choice.model_extra["token_ids"]) == MAX_TOKENS and choice.finish_reason == "length"
    lengths = [len(_ids(server, t)) for t in texts]
    assert r.usage.prompt_tokens == sum(lengths)
    assert r.usage.completion_tokens == MAX_TOKENS * len(texts)
    assert r.usage.total_tokens == sum(lengths) + MAX_TOKENS * len(texts)


@pytest.mark.parametrize("prompt", [["The capital of France"], [[504, 3575, 282]]], ids=["[text]", "[[ids]]"])
def test_a_list_of_one_prompt_is_served(server, prompt):
    """lm-eval's default `local-completions` sends `[[ids]]`, a batch of one."""
    r = server.client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert len(r.choices) == 1 and r.choices[0].index == 0


def test_echo_puts_each_prompt_before_its_own_completion(server):
    texts = ["alpha beta", "gamma delta epsilon"]
    r = server.client.completions.create(model=MODEL, prompt=texts, echo=True, **GREEDY)
    for choice, text in zip(r.choices, texts):
        assert choice.text.startswith(text), (choice.text, text)


def test_streamed_choices_carry_their_index_and_the_last_chunk_the_summed_usage(server):
    texts = ["The capital of France", "one two three four five"]
    chunks = list(server.client.completions.create(model=MODEL, prompt=texts, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY))
    per_index: dict[int, list[int]] = {0: [], 1: []}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        per_index[choice.index] += choice.model_extra["token_ids"]
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert {i: len(ids) for i, ids in per_index.items()} == {0: MAX_TOKENS, 1: MAX_TOKENS}
    assert finishes == {0: "length", 1: "length"}
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == sum(len(_ids(server, t)) for t in texts)
    assert last.usage.completion_tokens == 2 * MAX_TOKENS


@pytest.mark.parametrize("prompt,says", [
    (["a", 5], "mixes kinds of prompt"), ([[5], "a"], "mixes kinds of prompt"), (["a", ""], "prompt[1] is empty"),
    ([[5], []], "prompt[1] is not a non-empty list of token ids"), ([], "must be a prompt or a list of prompts"),
    (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}")])
def test_a_bad_prompt_list_is_a_400_naming_the_problem(server, prompt, says):
    r = httpx.post(server.url + "/v1/completions", headers=H, json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and says in err["message"], err


def test_a_refused_prompt_in_a_list_names_it_and_leaves_nothing_queued(server):
    vocab = server.engine.vocab_size
    body = {"model": MODEL, "prompt": [[5, 6], [7, vocab + 3]], "max_tokens": 1000, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", headers=H, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("prompt[1]: "), r.text
    wait_idle(server.engine, timeout=5)  # prompt[0] was queued first, and aborted with the refusal


def test_a_client_that_leaves_a_streamed_list_aborts_every_prompt(server):
    body = {"model": MODEL, "prompt": [[5, 6], [7, 8]], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=H, json=body, timeout=30) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(httpx.Response(200, content=line[6:]).json()["choices"][0]["index"])
            if seen == {0, 1}:
                break
    start = time.time()
    wait_idle(server.engine, timeout=5)  # 2 x 2000 tokens would take far longer than 5 s
    assert time.time() - start < 5


def test_n_choices_per_prompt_are_indexed_prompt_times_n_plus_i_with_seeds_seed_plus_i(server):
    """OpenAI's and vLLM's order (index = prompt_index * n + i); with a seed, choice i samples as the prompt
    alone would with seed + i (vLLM's rule), so the n choices differ yet each can be reproduced."""
    texts, n, seed = ["The capital of France", "one two three"], 3, 11
    kw = dict(temperature=1.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "return_token_ids": True})
    r = server.client.completions.create(model=MODEL, prompt=texts, n=n, seed=seed, **kw)
    assert [c.index for c in r.choices] == list(range(len(texts) * n))
    for k, choice in enumerate(r.choices):
        text, i = texts[k // n], k % n
        assert choice.model_extra["prompt_token_ids"] == _ids(server, text)
        alone = server.client.completions.create(model=MODEL, prompt=text, seed=seed + i, **kw)
        assert choice.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"], (k, text, i)
    assert r.usage.completion_tokens == MAX_TOKENS * len(texts) * n
    assert r.usage.prompt_tokens == n * sum(len(_ids(server, t)) for t in texts)


def test_streamed_n_choices_each_end_with_their_own_finish(server):
    chunks = list(server.client.completions.create(model=MODEL, prompt="The capital of France", n=2, stream=True,
                                                   **GREEDY))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
