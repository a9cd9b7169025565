"""Prometheus metrics, named like vLLM's (`vllm:time_to_first_token_seconds` -> `lab:time_to_first_token_seconds`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lab_utils.engine.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("lab:time_to_first_token_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("lab:inter_token_latency_seconds", "Time between output tokens", registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("lab:e2e_request_latency_seconds", "End-to-end request latency", registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("lab:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("lab:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("lab:request_success", "Requests finished", ["finished_reason"], registry=r)
        self.running = Gauge("lab:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("lab:num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("lab:kv_cache_usage_perc", "Share of KV blocks in use", registry=r)
        self.preemptions = Gauge("lab:num_preemptions", "Preemptions so far", registry=r)
        self.prefix_hit = Gauge("lab:prefix_cache_hit_rate", "Prefix cache hit rate (prompt tokens)", registry=r)
        self.step_failures = Counter("lab:engine_step_failures", "Engine steps that raised (isolated, see "
                                     "lab:request_failures)", registry=r)
        self.request_failures = Counter("lab:request_failures", "Requests ended by a failed engine step (HTTP 500)",
                                        registry=r)
        self.rejections = Counter("lab:requests_rejected", "Requests refused before the engine (4xx, 503)",
                                  ["status"], registry=r)
        self.learner_part = Gauge("lab:learner_part", "1 for each part (server or engine) that is the learner's", ["part"],
                                  registry=r)
        self._seen_tokens: dict[str, int] = {}

    def learner_parts(self, names) -> None:
        for name in names:
            self.learner_part.labels(name).set(1)

    def step_failed(self, num_requests_ended: int) -> None:
        self.step_failures.inc()
        self.request_failures.inc(num_requests_ended)

    def rejected(self, status: int) -> None:
        self.rejections.labels(str(status)).inc()

    def observe(self, out: RequestOutput) -> None:
        """Called from the engine loop for every output."""
        m = out.metrics
        n_prev = self._seen_tokens.get(out.request_id, 0)
        n_now = len(m.token_times)
        if n_prev == 0 and n_now > 0 and m.ttft is not None:
            self.ttft.observe(m.ttft)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        for a, b in zip(m.token_times[max(n_prev - 1, 0):], m.token_times[max(n_prev, 1):]):
            self.itl.observe(b - a)
        self.generation_tokens.inc(max(n_now - n_prev, 0))
        self._seen_tokens[out.request_id] = n_now
        if out.finished:
            self._seen_tokens.pop(out.request_id, None)
            if m.e2e is not None:
                self.e2e.observe(m.e2e)
            self.finished.labels((out.finish_reason or "unknown").split(":")[0]).inc()

    def refresh(self) -> None:
        """The gauges read from the engine now."""
        s = self.engine.stats()
        self.running.set(s["num_running"])
        self.waiting.set(s["num_waiting"])
        self.kv_usage.set(s["num_blocks_used"] / max(s["num_blocks_total"], 1))
        self.preemptions.set(s["num_preemptions"])
        self.prefix_hit.set(s["prefix_cache_hit_rate"])

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)


PROCESS_WIDE = ("lab:requests_rejected", "lab:learner_part")  # the first model's registry counts these for all


def render_all(by_model: dict[str, ServerMetrics]) -> bytes:
    """/metrics: one model's metrics as they are; several models' merged into one family per metric, each
    sample labelled with its `model_name` (vLLM's label), the process-wide ones (PROCESS_WIDE) unlabelled."""
    if len(by_model) == 1:
        return next(iter(by_model.values())).render()
    families: dict = {}
    for i, (name, metrics) in enumerate(by_model.items()):
        metrics.refresh()
        for family in metrics.registry.collect():
            if family.name in PROCESS_WIDE:
                if i == 0:
                    families[family.name] = family
                continue
            merged = families.setdefault(family.name, family)
            labelled = [s._replace(labels={"model_name": name, **s.labels}) for s in family.samples]
            if merged is family:
                family.samples = labelled
            else:
                merged.samples.extend(labelled)

    class Merged:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)
