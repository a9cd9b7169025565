"""Who serves the workload. Every backend takes a `Workload` and returns a `BenchRun`: per-request timestamps
(on `lab_utils.device.now()`'s clock) that `metrics.summarize` turns into vLLM-style numbers.

- `lab`: the course's `LLMEngine`, driven like a server: each request is added when its arrival time comes,
  the engine steps while it has work, and the loop sleeps when it is idle.
- `hf`:  Hugging Face `generate` in static batches with left padding: what a newcomer writes first. A batch
  takes up to `batch_size` requests that have arrived, runs until its longest request is done (shorter ones
  ride along, their extra tokens thrown away), and only then does the next batch start.
- `vllm` (offline `LLM`) and `http` (an OpenAI-compatible server) plug in through `register_backend` in a
  later issue; until then they are named in `PLANNED` so the CLI can say so instead of failing obscurely.

All backends generate greedily with EOS ignored, so each request produces exactly its `output_len` tokens and
every backend does the same work.
"""
from __future__ import annotations

import abc
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lab_utils.bench import metrics
from lab_utils.bench.workload import Workload
from lab_utils.device import now


@dataclass
class RequestResult:
    """One request's outcome; attribute names match what `metrics` reads."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (where the backend reports it)
    error: str | None = None


@dataclass
class BenchRun:
    backend: str
    model: str
    requests: list[RequestResult]
    start_time: float
    end_time: float
    config: dict = field(default_factory=dict)  # how the backend was set up (scheduler, batch size, ...)
    step_log: list[dict] = field(default_factory=list)  # lab backend: the engine's steps during this run
    stats: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time

    def outputs(self) -> dict[str, list[int]]:
        return {r.request_id: r.output_token_ids for r in self.requests}

    def summary(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                workload: Workload | None = None, detailed: bool = False) -> dict:
        """The vLLM `bench serve`-style result: metrics plus `backend`, `model` and how the run was set up.
        Duration runs from the start of the run (time 0 of the workload) to the last finish."""
        res = {"backend": self.backend, "model": self.model, "model_id": self.model}
        res.update(metrics.summarize(self.requests, self.duration, slo_ttft_ms, slo_tpot_ms))
        res["num_prompts"] = len(self.requests)
        res["errors"] = [r.error for r in self.requests if r.error]
        res["config"] = self.config
        if self.stats:
            res["engine_stats"] = self.stats
        if workload is not None:
            res["request_rate"] = workload.meta.get("request_rate")
            res["burstiness"] = workload.meta.get("burstiness")
            res["workload"] = dict(workload.meta, sha256=workload.content_hash)
        if detailed:
            res.update(metrics.per_request(self.requests))
        return res


class Backend(abc.ABC):
    """Serves a workload. Subclasses set `name` and implement `run`; `close` frees what they hold."""

    name: str = "?"
    model_name: str = "?"

    @abc.abstractmethod
    def run(self, workload: Workload, warmup: bool = True) -> BenchRun:
        ...

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def _sleep_until(t: float) -> None:
    dt = t - now()
    if dt > 0:
        time.sleep(dt)


# --------------------------------------------------------------------------------------------- lab
class LabBackend(Backend):
    """`LLMEngine` driven by arrival times. Pass a model name, or a (model, tokenizer) pair, or an engine."""

    name = "lab"
    _runs = itertools.count()

    def __init__(self, model="smollm2-135m", config=None, device: str = "auto", dtype=None, engine=None,
                 parts=None) -> None:
        """`parts`: the engine parts a learner wrote (`lab_utils.course.learner_parts.parts()`); None runs the reference."""
        from lab_utils.engine.engine import LLMEngine

        self.engine = engine if engine is not None else LLMEngine(model, config, device=device, dtype=dtype,
                                                                   parts=parts)
        m = self.engine.model
        self.model_name = model if isinstance(model, str) else getattr(m, "name", type(m).__name__)

    def describe(self) -> dict:
        c = self.engine.config
        return dict(scheduler=c.scheduler, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                    block_size=c.block_size, enable_prefix_caching=c.enable_prefix_caching,
                    enable_chunked_prefill=c.enable_chunked_prefill, kv_cache_dtype=c.kv_cache_dtype,
                    enforce_eager=c.enforce_eager, device=str(self.engine.device), dtype=str(self.engine.model.dtype),
                    speculative=None if c.speculative is None else vars(c.speculative))

    def run(self, workload: Workload, warmup: bool = True) -> BenchRun:
        from lab_utils.engine.sampling_params import SamplingParams

        eng = self.engine
        if warmup:  # compile and capture the batch sizes and contexts this workload will use, before measuring
            if eng.can_warm_up():
                eng.warmup(max_batch=len(workload.requests),
                           max_context=max(len(w.prompt_token_ids) + w.output_len for w in workload.requests))
            else:  # a used engine: its lazy initialisation is done; what it has not captured yet is captured lazily
                eng.generate([workload.requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
        prefix = f"r{next(self._runs)}-"  # engine request ids are unique for the engine's life
        pending = sorted(workload.requests, key=lambda r: r.arrival_time)
        first_step = len(eng.step_log)
        results: dict[str, RequestResult] = {}
        t0 = now()
        i = 0
        while i < len(pending) or eng.has_unfinished():
            t = now()
            while i < len(pending) and t0 + pending[i].arrival_time <= t:
                w = pending[i]
                eng.add_request(w.prompt_token_ids, SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                                request_id=prefix + w.request_id, arrival_time=t0 + w.arrival_time)
                i += 1
            if eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        results[out.request_id[len(prefix):]] = self._result(out, prefix)
            elif i < len(pending):
                _sleep_until(t0 + pending[i].arrival_time)
        end = max([r.finish_time for r in results.values() if r.finish_time is not None] or [now()])
        cut = len(prefix)  # the step log, with the workload's request ids
        log = [dict(s, requests=[(rid[cut:], n) for rid, n in s["requests"]], preempted=[r[cut:] for r in s["preempted"]])
               for s in eng.step_log[first_step:]]
        return BenchRun(self.name, self.model_name, [results[w.request_id] for w in workload.requests], t0, end,
                        self.describe(), log, eng.stats())

    @staticmethod
    def _result(out, prefix: str) -> RequestResult:
        m = out.metrics
        err = None if out.finish_reason in ("stop", "length") else out.finish_reason
        return RequestResult(out.request_id[len(prefix):], m.arrival_time, len(out.prompt_token_ids),
                             list(m.token_times), list(out.token_ids), m.first_token_time, m.finish_time,
                             out.finish_reason, m.first_scheduled_time, m.preemptions, err)


# --------------------------------------------------------------------------------------------- hf
class _StepClock:
    """A `generate` streamer that only notes when each step's tokens exist (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.times.append(now())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def load_hf_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """A `transformers` model for a course model name: the prepared folder for real models; for random ones
    the lab model's weights copied into HF's Llama (same parameter names), so both compute the same function."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from lab_utils.device import default_dtype, resolve_device
    from lab_utils.models.loader import build_random, model_folder
    from lab_utils.models.registry import lookup

    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    spec, _ = lookup(name)
    if spec is not None and spec.kind == "random":
        lab = build_random(spec.config)
        hf = LlamaForCausalLM(LlamaConfig(**spec.config))
        state = {k: v for k, v in lab.state_dict().items() if "rotary_emb" not in k}
        hf.load_state_dict(state, strict=False)
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_folder(name), dtype=torch.float32)
    return hf.to(device=dev, dtype=dtype).eval()


class HFBackend(Backend):
    """`model.generate` over static, left-padded batches of up to `batch_size` arrived requests."""

    name = "hf"

    def __init__(self, model: str = "smollm2-135m", batch_size: int = 8, device: str = "auto", dtype=None,
                 hf_model=None, tokenizer=None) -> None:
        from lab_utils.device import resolve_device

        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
        self.model_name, self.batch_size = model, batch_size
        self.device = resolve_device(device)
        self.model = hf_model if hf_model is not None else load_hf_model(model, self.device, dtype)
        if tokenizer is None:
            from lab_utils.models.loader import model_folder
            from lab_utils.models.registry import lookup
            from lab_utils.models.tokenizer import load_tokenizer

            spec, _ = lookup(model)
            tokenizer = load_tokenizer(model_folder(spec.tokenizer_from if spec and spec.kind == "random" else model))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def describe(self) -> dict:
        return dict(batch_size=self.batch_size, padding="left", device=str(self.device), dtype=str(self.model.dtype))

    def _generate(self, batch, max_new: int) -> tuple[torch.Tensor, list[float]]:
        L = max(r.input_len for r in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding: every prompt ends at the same column
            ids[j, L - r.input_len:] = torch.tensor(r.prompt_token_ids)
            mask[j, L - r.input_len:] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                      max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=self.pad_id,
                                      streamer=clock)
        return out[:, L:].cpu(), clock.times

    def run(self, workload: Workload, warmup: bool = True) -> BenchRun:
        if warmup:
            self._generate(workload.requests[:1], 2)
        pending = sorted(workload.requests, key=lambda r: r.arrival_time)
        results: dict[str, RequestResult] = {}
        t0 = now()
        i = 0
        while i < len(pending):
            _sleep_until(t0 + pending[i].arrival_time)  # nothing to do until the next request arrives
            t = now()
            batch = []
            while i < len(pending) and len(batch) < self.batch_size and t0 + pending[i].arrival_time <= t:
                batch.append(pending[i])
                i += 1
            started = now()
            tokens, times = self._generate(batch, max(r.output_len for r in batch))
            for j, r in enumerate(batch):
                tt = times[:r.output_len]
                results[r.request_id] = RequestResult(
                    r.request_id, t0 + r.arrival_time, r.input_len, tt, tokens[j, :r.output_len].tolist(),
                    tt[0], tt[-1], "length", started)
        end = max(r.finish_time for r in results.values())
        return BenchRun(self.name, self.model_name, [results[w.request_id] for w in workload.requests], t0, end,
                        self.describe())


# --------------------------------------------------------------------------------------------- registry
BACKENDS: dict[str, Callable[..., Backend]] = {}
PLANNED = {"vllm": "vLLM's offline LLM engine", "http": "any OpenAI-compatible server (vLLM, the lab server)"}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make `factory(model=..., **options)` available as `--backend name` (how `vllm` and `http` plug in)."""
    BACKENDS[name] = factory
    PLANNED.pop(name, None)


register_backend("lab", LabBackend)
register_backend("hf", HFBackend)


def _lazy(module: str, cls: str) -> Callable[..., Backend]:
    """A factory that imports its module on first use (vLLM's import alone takes seconds)."""
    def factory(**options) -> Backend:
        import importlib

        return getattr(importlib.import_module(module), cls)(**options)
    return factory


register_backend("vllm", _lazy("lab_utils.bench.backends_vllm", "VLLMBackend"))
register_backend("http", _lazy("lab_utils.bench.backends_http", "HTTPBackend"))


def make_backend(name: str, **options) -> Backend:
    if name in BACKENDS:
        return BACKENDS[name](**options)
    if name in PLANNED:
        raise ValueError(f"backend {name!r} ({PLANNED[name]}) is not available yet; available: {sorted(BACKENDS)}")
    raise ValueError(f"backend {name!r} is invalid: must be one of {sorted(BACKENDS)}")
