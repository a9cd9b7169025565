"""lm-eval (EleutherAI's harness) runs against the server with its default `local-completions` settings: token-id
prompts sent as `[[ids]]` (tokenized_requests=True), loglikelihoods read from `echo` + `logprobs`, generations
ended by `stop`. The tasks are two small local ones written here (no data set is downloaded), the tokenizer the
repo's SmolLM2 folder. The loglikelihoods lm-eval reads through the server equal the model's own log-softmax."""
from __future__ import annotations

import json

import pytest
import torch
from _server_utils import MODEL, UvicornThread

lm_eval = pytest.importorskip("lm_eval", reason="skipped: lm-eval is not installed (pip install 'lm-eval[api]')")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lab_utils import EngineConfig, LLMEngine  # noqa: E402
from lab_utils.models.loader import model_folder  # noqa: E402
from lab_utils.server.app import create_app  # noqa: E402

QUESTIONS = [  # (question, answer, choices, the answer's lead-in for the generation task)
    ("What is the capital of France?", "Paris", ["Paris", "Berlin", "Madrid", "Rome"], "The capital of France is"),
    ("What is the capital of Germany?", "Berlin", ["Oslo", "Berlin", "Lisbon", "Vienna"], "The capital of Germany is"),
    ("What is the capital of Italy?", "Rome", ["Athens", "Dublin", "Rome", "Prague"], "The capital of Italy is"),
    ("What is the capital of Spain?", "Madrid", ["Madrid", "Warsaw", "Paris", "Bern"], "The capital of Spain is"),
    ("What color is the sky on a clear day?", "blue", ["green", "blue", "red", "black"], "On a clear day the sky is"),
    ("How many legs does a dog have?", "four", ["two", "six", "four", "eight"], "A dog has")]
TASKS = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
{body}"""
MC = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
"""
GEN = """output_type: generate_until
doc_to_text: "Q: {{question}}\\nA: {{lead}}"
doc_to_target: " {{answer}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lmeval_tasks")
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a, "choices": c, "label": c.index(a), "lead": lead})
                            + "\n" for q, a, c, lead in QUESTIONS))
    (folder / "lab_mc.yaml").write_text(TASKS.format(name="lab_mc", data=data, body=MC))
    (folder / "lab_gen.yaml").write_text(TASKS.format(name="lab_gen", data=data, body=GEN))
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def served(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512), device="cpu")
    with UvicornThread(create_app(engine, MODEL, max_tokens_cap=256)) as srv:
        lm = get_model("local-completions").create_from_arg_string(  # the defaults but for where to find things
            f"model={MODEL},base_url={srv.url}/v1/completions,tokenizer={model_folder('smollm2-135m')}")
        yield lm


def test_the_defaults_send_token_ids(served):
    assert served.tokenized_requests is True


def test_both_tasks_run_on_every_document(served, tasks):
    out = lm_eval.simple_evaluate(model=served, tasks=["lab_mc", "lab_gen"], task_manager=tasks, log_samples=True)
    for name in ("lab_mc", "lab_gen"):
        assert len(out["samples"][name]) == len(QUESTIONS), name
    assert 0.0 <= out["results"]["lab_mc"]["acc,none"] <= 1.0
    assert 0.0 <= out["results"]["lab_gen"]["exact_match,none"] <= 1.0
    for sample in out["samples"]["lab_gen"]:  # generations ended by the stop string, not run on
        (text,) = sample["resps"][0]
        assert "\n" not in text and "." not in text and text.strip(), sample["resps"]


def test_loglikelihoods_through_the_server_equal_the_models_log_softmax(served, smollm2):
    model, _ = smollm2
    pairs = [(f"Question: {q}\nAnswer:", f" {c}") for q, _, choices, _ in QUESTIONS[:3] for c in choices[:2]]
    got = served.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (loglik, _) in zip(pairs, got):
        ctx, cont = served._encode_pair(context, continuation)
        with torch.no_grad():
            logp = model(torch.tensor([ctx + cont]))[0].float().log_softmax(-1)  # model(ids) -> logits
        want = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
        assert abs(loglik - want) < 1e-3, (context, continuation, loglik, want)
