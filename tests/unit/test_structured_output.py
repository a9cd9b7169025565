"""Grammar-constrained decoding in the engine (lab_utils.structured.hook): valid by construction, invisible to
unconstrained neighbours, lossless under speculative decoding, kept across preemption."""
from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("xgrammar")

from lab_utils import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from lab_utils.engine.config import SpecConfig  # noqa: E402
from lab_utils.structured.hook import (  # noqa: E402
    StructuredOutputs,
    advance_matcher,
    apply_token_bitmask,
    choice_grammar,
    unpack_bitmask,
)
from lab_utils.structured.params import StructuredOutputParams  # noqa: E402
from lab_utils.structured.tasks import (  # noqa: E402
    extract_json,
    json_tasks,
    lenient_valid,
    schema_valid,
)

TASKS = json_tasks(12, seed=3)


def _so(task) -> dict:
    return {"json": task.schema, "disable_any_whitespace": True}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49152) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def _run(model_tok, prompts, params, **cfg):
    spec = cfg.pop("speculative", None)
    eng = LLMEngine(model_tok, EngineConfig(speculative=spec, **cfg), device="cpu")
    outs = eng.generate(prompts, params)
    eng.block_manager.check_all_free()
    assert not eng.structured.matchers, "every matcher is released when its request ends"
    return eng, outs


# ------------------------------------------------------------------------------------------ the mask step
def test_unpack_and_apply_match_xgrammar_kernel():
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(5, vocab, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    assert torch.equal(apply_token_bitmask(logits, bitmask), want)
    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed.shape == (5, vocab)
    assert bool(allowed[0, 3]) == bool((int(bitmask[0, 0]) >> 3) & 1)


def test_advance_matcher_stops_at_a_refused_token(smollm2_tok):
    so = StructuredOutputs(smollm2_tok, 49152, [2])
    m = so.compiler.matcher(so.compile({"choice": ["yes", "no"]}))
    yes = smollm2_tok("yes", add_special_tokens=False).input_ids
    assert advance_matcher(m, yes) and advance_matcher(m, [2]) and m.is_terminated()
    m2 = so.compiler.matcher(so.compile({"choice": ["yes", "no"]}))
    assert not advance_matcher(m2, smollm2_tok("maybe", add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def smollm2_tok(tiny64):
    return tiny64[1]


# ------------------------------------------------------------------------------------------ params
def test_params_are_validated():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputParams(json="{not json")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputParams(choice=[])
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_output={"jsn": {}})
    assert SamplingParams(structured_output={"regex": "a+"}).structured_output.kind == "regex"


def test_bad_schema_is_a_value_error_and_nothing_is_queued(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=32, block_size=4), device="cpu")
    with pytest.raises(ValueError, match="structured_output.json could not be compiled.*frob"):
        eng.add_request([5, 6, 7], SamplingParams(structured_output={"json": {"type": "frob"}}))
    with pytest.raises(ValueError, match="structured_output.regex could not be compiled"):
        eng.add_request([5, 6, 7], SamplingParams(structured_output={"regex": "(unclosed"}))
    assert not eng.has_unfinished() and not eng.requests


# ------------------------------------------------------------------------------------------ the engine
def test_constrained_outputs_are_schema_valid_and_neighbours_untouched(tiny64):
    """Half constrained, half free, one batch: every constrained output is valid; every free one is token for
    token what it is with no constrained neighbour (the same prompts, all free)."""
    prompts = _prompts(12)
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    mixed = [SamplingParams(max_tokens=200, structured_output=_so(t)) if i % 2 == 0 else free
             for i, t in enumerate(TASKS)]
    cfg = dict(block_size=4, num_gpu_blocks=1200, max_num_batched_tokens=48, max_num_seqs=8)
    eng, outs = _run(tiny64, prompts, mixed, **cfg)
    _, alone = _run(tiny64, prompts, [free] * len(prompts), **cfg)
    for i, (o, t) in enumerate(zip(outs, TASKS)):
        if i % 2 == 0:
            assert o.finish_reason == "stop" and schema_valid(o.text, t.schema), (o.text, o.finish_reason)
        else:
            assert o.token_ids == alone[i].token_ids
    st = eng.structured.stats()
    assert st["structured_steps"] > 0 and st["mask_exposed_ms"] >= 0


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_switch_changes_nothing_but_timing(tiny64, overlap):
    prompts = _prompts(4, seed=1)
    params = [SamplingParams(max_tokens=200, structured_output=_so(t)) for t in TASKS[:4]]
    eng = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=400), device="cpu")
    eng.structured.overlap = overlap
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    ref = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=400), device="cpu")
    assert outs == [o.token_ids for o in ref.generate(prompts, params)]
    log = eng.structured.step_log
    assert log and all((e["inline_ms"] > 0) == (not overlap) for e in log)


def test_choice_regex_and_grammars(tiny64):
    ebnf = 'root ::= "(" [0-9]+ ")"'
    lark = 'start: "[" word "]"\nword: /[a-z]+/'
    kinds = [{"choice": ["red", "green", "blue"]}, {"regex": r"[A-Z][a-z]{2,5}-[0-9]{2}"},
             {"grammar": ebnf}, {"grammar": lark}, {"json_object": True, "disable_any_whitespace": True}]
    params = [SamplingParams(max_tokens=60, structured_output=k) for k in kinds]
    _, outs = _run(tiny64, _prompts(5, seed=2), params, block_size=4, num_gpu_blocks=200)
    import re

    assert outs[0].text in ("red", "green", "blue")
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", outs[1].text)
    assert re.fullmatch(r"\([0-9]+\)", outs[2].text) or outs[2].finish_reason == "length"
    assert re.fullmatch(r"\[[a-z]+\]", outs[3].text) or outs[3].finish_reason == "length"
    assert outs[4].finish_reason == "length" or isinstance(json.loads(outs[4].text), dict)
    assert choice_grammar(['a"b']) == r'root ::= "a\"b"'


def test_sampling_with_a_grammar_stays_valid(tiny64):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured_output=_so(t))
              for i, t in enumerate(TASKS[:6])]
    _, outs = _run(tiny64, _prompts(6, seed=4), params, block_size=4, num_gpu_blocks=600)
    assert all(schema_valid(o.text, t.schema) for o, t in zip(outs, TASKS)), [o.text for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_matcher(tiny64, mode):
    """A pool too small for everyone: requests are preempted mid-generation and resume with the same grammar
    state (identical outputs to a run with room for all)."""
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(max_tokens=120, structured_output=_so(t)) for t in TASKS[:6]]
    eng, small = _run(tiny64, prompts, params, block_size=4, num_gpu_blocks=40, max_num_seqs=6,
                      preemption_mode=mode)
    assert eng.stats()["num_preemptions"] > 0
    _, big = _run(tiny64, prompts, params, block_size=4, num_gpu_blocks=600)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert all(schema_valid(o.text, t.schema) for o, t in zip(small, TASKS))


def test_chunked_prefill_and_prefix_cache(tiny64):
    shared = _prompts(1, seed=6)[0] * 3
    prompts = [shared + p for p in _prompts(4, seed=7)]
    params = [SamplingParams(max_tokens=120, structured_output=_so(t)) for t in TASKS[:4]]
    eng, chunked = _run(tiny64, prompts, params, block_size=4, num_gpu_blocks=600, max_num_batched_tokens=8,
                        max_num_seqs=2)
    assert eng.stats()["prefix_cache_hit_rate"] > 0
    _, whole = _run(tiny64, prompts, params, block_size=4, num_gpu_blocks=600, enable_prefix_caching=False)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


@pytest.fixture(scope="module")
def other_draft():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float64, seed=7)[0]


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
def test_speculative_decoding_with_a_grammar_is_greedy_identical(tiny64, other_draft, method):
    """Guesses come from an unconstrained proposer, so many break the grammar: they are cut or rejected, and
    the output equals non-speculative constrained decoding token for token."""
    from lab_utils.speculative.draft import DraftModelProposer

    prompts = [p * 3 for p in _prompts(5, seed=8)]  # repeats: n-gram lookup finds guesses
    params = [SamplingParams(max_tokens=120, structured_output=_so(t)) if i % 3 else
              SamplingParams(max_tokens=20, ignore_eos=True) for i, t in enumerate(TASKS[:5])]
    cfg = dict(block_size=4, num_gpu_blocks=800, max_num_batched_tokens=32, max_num_seqs=4)
    _, base = _run(tiny64, prompts, params, **cfg)
    eng = LLMEngine(tiny64, EngineConfig(speculative=SpecConfig("ngram", 3), **cfg), device="cpu")
    if method != "ngram":
        eng.spec.proposer = DraftModelProposer(SpecConfig("draft", 3, model="tiny-random"), tiny64[0], "cpu",
                                               draft_model=other_draft)
    outs = eng.generate(prompts, params)
    eng.block_manager.check_all_free()
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    st = eng.stats()
    assert st["spec_num_verify_steps"] > 0
    for o, p, t in zip(outs, params, TASKS):
        if p.structured_output is not None:
            assert schema_valid(o.text, t.schema)


def test_a_broken_mask_fails_only_its_request(tiny64):
    """A mask function that masks nothing lets the model pick tokens the grammar refuses: that request ends
    with an error naming the token; its neighbour finishes normally."""
    eng = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=200), device="cpu")
    eng.structured.mask_fn = lambda logits, bitmask: logits
    outs = eng.generate(_prompts(2, seed=9), [SamplingParams(max_tokens=40, structured_output=_so(TASKS[0])),
                                              SamplingParams(max_tokens=10, ignore_eos=True)])
    assert outs[0].finish_reason.startswith("error: the grammar refused token")
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 10
    eng.block_manager.check_all_free()


def test_task_set_and_validity_checks():
    tasks = json_tasks(60, seed=0)
    assert len(tasks) == 60 and len({t.kind for t in tasks}) == 6
    assert [t.question for t in json_tasks(60, seed=0)] == [t.question for t in tasks]
    t = tasks[0]
    good = json.dumps(t.expected)
    assert schema_valid(good, t.schema) and schema_valid(f"  {good}\n", t.schema)
    assert not schema_valid(f"```json\n{good}\n```", t.schema)
    assert lenient_valid(f"```json\n{good}\n```", t.schema) and extract_json("x {\"a\": 1} y") == {"a": 1}
    assert not schema_valid(json.dumps({**t.expected, "extra": 1}), t.schema)


@pytest.mark.slow
def test_smollm2_task_set_is_100_percent_valid_when_constrained(smollm2):
    """The real model on 50 tasks: with the grammar every output is schema-valid."""
    model, tok = smollm2
    tasks = json_tasks(50, seed=0)
    prompts = [tok.apply_chat_template(t.messages(), tokenize=False, add_generation_prompt=True) for t in tasks]
    eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=64), device="cpu")
    outs = eng.generate(prompts, [SamplingParams(max_tokens=96, structured_output=_so(t)) for t in tasks])
    bad = [(t.task_id, o.text, o.finish_reason) for o, t in zip(outs, tasks) if not schema_valid(o.text, t.schema)]
    assert not bad, bad
