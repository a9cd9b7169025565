"""A learner's parts run wherever the course builds an engine after their lab: a folder holding the parts of labs
01-05 (the labs' own solutions, saved the way `learner_parts.submit` saves them) gives lab 07 a parts table that names
them as the learner's, and the engines built the way labs 07, 08, 12 and 13 build them call those parts."""
from __future__ import annotations

import collections
import functools
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.course import learner_parts
from lab_utils.course import parts as parts_mod
from lab_utils.engine.config import SpecConfig
from lab_utils.course.parts import PARTS
from lab_utils.models.loader import load_model
from lab_utils.paths import REPO_ROOT

MODEL = "tiny-random"
WRITTEN = [n for n, p in PARTS.items() if p.lab <= "05"]  # the parts of labs 01-05
# what every engine of labs 07-13 runs on any workload (token-budget scheduler, paged KV)
ALWAYS = {"engine.stop_reason", "scheduler.schedule_token_budget", "block_manager.grow", "block_manager.release",
          "block_manager.commit_full_blocks", "block_manager.match_prefix", "block_manager.recycle"}


def expected(engine: LLMEngine) -> set[str]:
    """The learner's parts `engine` must call on a workload of prompts longer than a block."""
    return ALWAYS | ({"block_manager.hash_block"} if engine.config.enable_prefix_caching else set())


def _solution(lab: str, attr: str) -> str:
    """The top-level `def attr(...)` of lab `lab`'s notebook, as the exercise cell holds it (with its solution)."""
    nb = nbformat.read(next((REPO_ROOT / "labs").glob(f"{lab}_*.ipynb")), as_version=4)
    for cell in nb.cells:
        lines = cell.source.splitlines() if cell.cell_type == "code" else []
        start = next((i for i, line in enumerate(lines) if re.match(rf"(async )?def {attr}\(", line)), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "\t", ")")),
                       len(lines))
            return "\n".join(lines[start:end]).rstrip() + "\n"
    raise LookupError(f"no def {attr} in lab {lab}")


@pytest.fixture(scope="module")
def solutions_module(tmp_path_factory) -> object:
    """The labs' solutions of every part of labs 01-05, in a module of their own (so `inspect` can read them)."""
    path = tmp_path_factory.mktemp("solutions") / "lab_solutions.py"
    body = "\n\n".join(_solution(PARTS[n].lab, PARTS[n].attr).replace(f"def {PARTS[n].attr}(", f"def {n.replace('.', '__')}(", 1)
                       for n in WRITTEN)
    path.write_text(learner_parts._HEADER.format(component="solutions") + "\n\n" + body, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("lab_solutions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def learner_folder(tmp_path, monkeypatch, solutions_module) -> Path:
    """A my_engine/ folder with the parts of labs 01-05, and no kernel registry (a later lab's fresh kernel)."""
    folder = tmp_path / "my_engine"
    monkeypatch.setenv("LAB_LEARNER_DIR", str(folder))
    learner_parts.forget()
    for name in WRITTEN:
        learner_parts.submit(name, getattr(solutions_module, name.replace(".", "__")))
    learner_parts.forget()
    yield folder
    learner_parts.forget()


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Calls of every learner's part from now on, by part name, across every `EngineParts` (`EngineParts.calls`
    counts per parts object; the lab 12 server builds its own from its CLI arguments, out of the test's reach)."""
    counter: collections.Counter = collections.Counter()
    guarded = parts_mod._guarded

    def counting(name, fn, *more):
        inner = guarded(name, fn, *more)

        @functools.wraps(inner)
        def call(*args, **kwargs):
            counter[name] += 1
            return inner(*args, **kwargs)

        return call

    monkeypatch.setattr(parts_mod, "_guarded", counting)
    return counter


@pytest.fixture(scope="module")
def model_tok():
    return load_model(MODEL, device="cpu", dtype=torch.float32)


def _prompts(tok, n=4):
    base = "the quick brown fox jumps over the lazy dog and then the dog runs after the fox " * 2
    return [tok(base + f"number {i}", add_special_tokens=False).input_ids for i in range(n)]


def test_lab07_table_names_the_learners_parts(learner_folder, capsys):
    parts = learner_parts.parts(upto="07")
    table = capsys.readouterr().out
    for name in WRITTEN:
        line = next(line for line in table.splitlines() if f" {name} " in line)
        if PARTS[name].carry:
            assert f"yours ({learner_folder.name}/{PARTS[name].component}.py)" in line, line
            assert parts.is_learners(name)
        else:  # the slot mapping: the learner's ran in lab 02; later labs keep the fast attention
            assert "reference" in line and "yours ran in its lab" in line, line
    assert all("you have not written it yet" in line for line in table.splitlines() if " spec." in line)
    # the check's engine takes only lab 07's parts: the others are said to be saved, not missing
    learner_parts.parts(upto="07", only=["spec.residual"])
    checked = capsys.readouterr().out
    assert "quant.quantize_per_channel_int8" in checked
    assert not any("not written" in line for line in checked.splitlines() if " quant." in line or " kv_cache." in line)
    assert "left out of this engine by only=" in checked


def test_lab07_engines_and_the_self_draft_call_the_learners_parts(learner_folder, calls, model_tok):
    from lab_utils.speculative.measure import build_engines

    model, tok = model_tok
    parts = learner_parts.parts(upto="07", quiet=True)
    methods = {"none": None, "ngram k=3": SpecConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=5),
               "self-draft k=3": SpecConfig("draft", 3, model=MODEL, quantization="w8a8-g32")}
    engines = build_engines((model, tok), methods, device="cpu", parts=parts)
    assert calls["quant.quantize_per_channel_int8"] > 0, "the self-draft was quantized without the learner's INT8"
    for name, eng in engines.items():
        calls.clear()
        eng.generate(_prompts(tok), SamplingParams(max_tokens=8, ignore_eos=True))
        eng.block_manager.check_all_free()
        missing = sorted(n for n in expected(eng) if calls[n] == 0)
        assert not missing, f"lab 07's {name} engine did not call the learner's {missing}"


def test_lab08_backend_calls_the_learners_parts(learner_folder, calls, model_tok):
    from lab_utils.bench.backends import LabBackend
    from lab_utils.bench.workload import Workload, WorkloadRequest

    model, tok = model_tok
    parts = learner_parts.parts(upto="08", quiet=True)
    # lab 08's sweep: chunked prefill, prefix cache, an FP8 KV cache, a KV budget too small for all at once
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, num_gpu_blocks=10,
                       enable_prefix_caching=True, enable_chunked_prefill=True, kv_cache_dtype="fp8")
    backend = LabBackend((model, tok), cfg, device="cpu", parts=parts)
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(100, 5000, (40,), generator=g).tolist() for _ in range(4)]  # 3 blocks each, none shared
    wl = Workload([WorkloadRequest(f"r{i}", p, 40, 0.0) for i, p in enumerate(_prompts(tok, 2) + distinct)])
    run = backend.run(wl, warmup=False)
    assert not run.summary()["errors"]
    backend.engine.block_manager.check_all_free()
    want = expected(backend.engine) | {"kv_cache.fp8_encode", "kv_cache.fp8_decode", "scheduler.make_room", "scheduler.preempt"}
    missing = sorted(n for n in want if calls[n] == 0)
    assert not missing, f"lab 08's backend did not call the learner's {missing}"


def test_lab12_server_runs_the_learners_engine(learner_folder, calls, monkeypatch):
    from starlette.testclient import TestClient

    from lab_utils.__main__ import build_parser
    from lab_utils.server.app import create_app
    from lab_utils.server.cli import build_engine
    from lab_utils.server.streaming import stream_sse

    learner_parts.submit("server.stream_sse", stream_sse)  # lab 12's own part
    learner_parts.forget()
    load_part = learner_parts.load_part

    def counted_load_part(name):  # the server loads its loop with load_part, outside EngineParts: count it here
        fn = load_part(name)

        def counted(*args):
            calls[name] += 1
            return fn(*args)

        return None if fn is None else counted

    monkeypatch.setattr(learner_parts, "load_part", counted_load_part)
    # the server process lab 12 starts: LabServer(..., learner_parts=["server.stream_sse"], learner_upto="12")
    args = build_parser("serve").parse_args(["serve", "--model", MODEL, "--device", "cpu", "--dtype", "float32",
                                             "--max-num-seqs", "8", "--learner-parts", "server.stream_sse",
                                             "--learner-upto", "12"])
    engine = build_engine(args)
    app = create_app(engine, MODEL, learner_parts=args.learner_parts)
    with TestClient(app) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time " * 8, "max_tokens": 6,
                                                     "ignore_eos": True, "temperature": 0, "stream": stream})
            assert r.status_code == 200, r.text
        metrics = client.get("/metrics").text
    served = {m.group(1) for m in re.finditer(r'^lab:learner_part\{part="([^"]+)"\} 1\.0', metrics, re.M)}
    want = expected(engine) | {"server.stream_sse"}
    assert served >= want, f"/metrics names {sorted(served)}"
    missing = sorted(n for n in want if calls[n] == 0)
    assert not missing, f"lab 12's server did not call the learner's {missing}"


def test_lab13_engines_call_the_learners_parts(learner_folder, calls, model_tok):
    model, tok = model_tok
    parts = learner_parts.parts(upto="13", quiet=True)
    engine = LLMEngine((model, tok), EngineConfig(max_num_seqs=64, kv_cache_memory_bytes=8 << 20), device="cpu",
                       parts=parts)  # lab 13's config, with the learner's parts
    engine.generate(_prompts(tok), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.block_manager.check_all_free()
    missing = sorted(n for n in expected(engine) if calls[n] == 0)
    assert not missing, f"lab 13's engine did not call the learner's {missing}"


def test_the_engines_quantizers_are_the_learners(learner_folder, calls, model_tok):
    model, tok = model_tok
    parts = learner_parts.parts(upto="05", quiet=True)
    for method, used in (("int8", ["quant.quantize_per_channel_int8"]),
                         ("int4", ["quant.quantize_per_group_int4", "quant.dequantize_int4"])):
        calls.clear()
        eng = LLMEngine((model, tok), learner_parts.engine_config("05", quantization=method, num_gpu_blocks=32), device="cpu",
                        parts=parts)
        eng.generate(_prompts(tok, 2), SamplingParams(max_tokens=3, ignore_eos=True))
        assert all(calls[n] > 0 for n in used), dict(calls)


@pytest.mark.timeout(400)
def test_lab10_baseline_and_both_workers_run_the_learners_engine(learner_folder, calls, tmp_path):
    """Lab 10: the colocated baseline (in the notebook's process) calls the learner's parts, and the prefill and
    decode workers (processes of their own) build their engines from the same saved parts."""
    from lab_utils.disagg import DisaggregatedCluster, colocated_run
    from lab_utils.parallel.toy_model import write_toy_model

    toy = str(write_toy_model(tmp_path / "toy"))
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=128)
    prompts = [list(range(5, 14 + 3 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    parts = learner_parts.parts(upto="09", quiet=True)
    engine = LLMEngine(load_model(toy, device="cpu", dtype=torch.float64), cfg, device="cpu", parts=parts)
    ref = colocated_run(engine, cfg, prompts, params)
    missing = sorted(n for n in expected(engine) if calls[n] == 0)
    assert not missing, f"lab 10's baseline did not call the learner's {missing}"
    with DisaggregatedCluster(toy, cfg, dtype="float64", startup_timeout_s=240, engine_parts_upto="09") as cluster:
        outs = cluster.generate(prompts, params, timeout_s=240)
        ran = dict(cluster.learner_parts_ran)
    mine = sorted(n for n in parts.overrides if not n.startswith("disagg."))
    assert set(mine) >= ALWAYS and ran == {"prefill": mine, "decode": mine}, ran
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]  # float64: no near-tie to allow for
