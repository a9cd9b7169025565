"""`vllm` backend: real vLLM's offline engine on the same model folder, prompts and sampling as the lab engine.

The engine is driven exactly like the `lab` backend drives `LLMEngine`: each request is added (as token ids,
so both engines see identical prompts) when its arrival time comes, the engine steps while it has work, and
every token gets the timestamp of the step that produced it, on the same clock (`lab_utils.device.now`).
Greedy and EOS ignored, so each request produces exactly its `output_len` tokens.

Flags keep the lab engine's names (`max_num_seqs`, `kv_cache_memory_bytes`, `num_gpu_blocks`, ...; see
`lab_utils.vllm_env.llm_kwargs`). vLLM on CPU gets an explicit KV budget (128 MiB unless told) and an
engine-level seed: a per-request seed fails there once a prompt is chunked.
"""
from __future__ import annotations

import itertools

from lab_utils import vllm_env
from lab_utils.bench.backends import Backend, BenchRun, RequestResult, _sleep_until
from lab_utils.bench.workload import Workload
from lab_utils.device import now

# EngineConfig fields that mean the same thing in vLLM (num_gpu_blocks -> num_gpu_blocks_override)
SHARED_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes", "num_gpu_blocks",
                "enable_prefix_caching", "enable_chunked_prefill", "kv_cache_dtype", "enforce_eager", "max_model_len")


def _model_path(model) -> str:
    from lab_utils.models.loader import model_folder

    return str(model_folder(str(model)))


def vllm_sampling_params(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         ignore_eos: bool = True, stop=None, stop_token_ids=None):
    """The lab's `SamplingParams` fields -> vLLM's (top_k 0 = off in the lab, -1 in vLLM). No per-request seed."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k if top_k > 0 else -1, ignore_eos=ignore_eos, stop=stop or None,
                          stop_token_ids=stop_token_ids or None, detokenize=False)


def vllm_fields(p) -> dict:
    """A lab `SamplingParams` as the keyword arguments of vLLM's (the same meaning field by field: the logit
    processors, min_tokens, logprobs and the seed are vLLM's definitions). Structured output is refused with a
    ValueError: vLLM's way of asking for it differs between its versions."""
    if p.structured_output is not None:
        raise ValueError("structured_output is not passed to vLLM by this backend: run constrained requests on the "
                         "lab engine, or send them to a vLLM server through the http backend (response_format)")
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1, seed=p.seed, ignore_eos=p.ignore_eos,
                stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
                logit_bias=dict(p.logit_bias) if p.logit_bias else None, min_tokens=p.min_tokens,
                repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                presence_penalty=p.presence_penalty, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
                detokenize=bool(p.stop))  # vLLM matches stop strings on the text: only then is it decoded


def from_lab_params(p):
    """A lab `SamplingParams` -> vLLM's, every field carried over (`vllm_fields`)."""
    from vllm import SamplingParams

    return SamplingParams(**vllm_fields(p))


class VLLMBackend(Backend):
    """vLLM's `LLM` in this process. `config` may be a lab `EngineConfig` (its shared flags are copied, so both
    engines run with the same settings), keyword flags override it, and `args` (the bench CLI's namespace)
    builds that config from the command line. `llm` reuses an engine already built (a start costs seconds).
    On CPU `enforce_eager` stays True unless passed as a keyword: compiling costs minutes on two cores."""

    name = "vllm"
    _runs = itertools.count()

    def __init__(self, model="smollm2-135m", config=None, device: str = "auto", dtype=None, llm=None,
                 seed: int = 0, args=None, **flags) -> None:
        vllm_env.require()
        from vllm import LLM

        if args is not None:
            from lab_utils.engine.cli import engine_config_from_args, torch_dtype

            config = config or engine_config_from_args(args)
            device, dtype = getattr(args, "device", device), dtype or torch_dtype(getattr(args, "dtype", None))
            if getattr(args, "enforce_eager", None) is not None:
                flags.setdefault("enforce_eager", args.enforce_eager)
        on_gpu = str(device) == "cuda" or (str(device) == "auto" and not vllm_env.is_cpu())
        opts: dict = {"dtype": "bfloat16" if on_gpu else "float32"}  # the lab engine's defaults
        if config is not None:
            if getattr(config, "quantization", None) or getattr(config, "speculative", None):
                raise ValueError("the vllm backend maps engine flags only; quantization and speculative "
                                 "decoding are not mapped: leave them off for a side-by-side run")
            opts.update({k: getattr(config, k) for k in SHARED_FLAGS
                         if k != "enforce_eager" and getattr(config, k, None) is not None})
            seed = getattr(config, "seed", seed)
        self.notes: list[str] = []
        bs = opts.get("block_size")
        if not on_gpu and bs is not None and bs % 32 and "block_size" not in flags:
            # vLLM's CPU attention kernels need a multiple of 32; the lab's default is 16. Say so, use vLLM's own.
            self.notes.append(f"block_size {bs} from the lab config is not a multiple of 32 (vLLM CPU attention "
                              f"needs that): vLLM used its CPU default; pass block_size=32 to both engines to match")
            del opts["block_size"]
        if on_gpu:
            opts["enforce_eager"] = False  # CUDA graphs pay off on a GPU
        opts.update({k: v for k, v in flags.items() if v is not None})
        if dtype is not None:
            opts["dtype"] = str(dtype).replace("torch.", "")
        self.model_name = str(model)
        self.kwargs = vllm_env.llm_kwargs(seed=seed, **opts)
        self.llm = llm if llm is not None else LLM(model=_model_path(model), **self.kwargs)
        self.engine = self.llm.llm_engine

    def describe(self) -> dict:
        d = {k: v for k, v in self.kwargs.items() if k != "disable_log_stats"}
        d["num_gpu_blocks"] = self.num_kv_blocks()
        d["block_size"] = self.llm.llm_engine.vllm_config.cache_config.block_size if self.llm else d.get("block_size")
        if self.notes:
            d["notes"] = self.notes
        d["vllm"] = vllm_env.available()[1]
        return d

    def num_kv_blocks(self) -> int | None:
        try:
            return self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        except AttributeError:
            return None

    def metrics(self) -> dict:
        """vLLM's own Prometheus metrics, read in-process: name -> value (counters, gauges) or, for histograms,
        {"count", "sum", "buckets"}. Summed over label sets (one engine here)."""
        return prometheus_dict(self.llm.get_metrics())

    def run(self, workload: Workload, warmup: bool = True) -> BenchRun:
        eng = self.engine
        if warmup:
            self.llm.generate([{"prompt_token_ids": workload.requests[0].prompt_token_ids[:8]}],
                              vllm_sampling_params(2), use_tqdm=False)
        prefix = f"v{next(self._runs)}-"
        pending = sorted(workload.requests, key=lambda r: r.arrival_time)
        by_id = {w.request_id: w for w in workload.requests}
        res: dict[str, RequestResult] = {}
        seen: dict[str, int] = {}
        t0 = now()
        i = 0
        while i < len(pending) or eng.has_unfinished_requests():
            t = now()
            while i < len(pending) and t0 + pending[i].arrival_time <= t:
                w = pending[i]
                eng.add_request(prefix + w.request_id, {"prompt_token_ids": list(w.prompt_token_ids)},
                                vllm_sampling_params(w.output_len))
                res[w.request_id] = RequestResult(w.request_id, t0 + w.arrival_time, w.input_len)
                i += 1
            if eng.has_unfinished_requests():
                outs = eng.step()
                t = now()
                for out in outs:
                    rid = _external_id(out.request_id, prefix)
                    r = res[rid]
                    toks = list(out.outputs[0].token_ids)
                    n_new = len(toks) - seen.get(rid, 0)
                    seen[rid] = len(toks)
                    if n_new > 0:
                        if r.first_token_time is None:
                            r.first_token_time = t
                        r.token_times.extend([t] * n_new)
                    if out.finished:
                        r.output_token_ids = toks
                        r.finish_time = t
                        r.finish_reason = out.outputs[0].finish_reason or "length"
                        stats = getattr(out, "metrics", None)
                        r.preemptions = int(getattr(stats, "num_preemptions", 0) or 0)
                        r.num_cached_tokens = int(getattr(out, "num_cached_tokens", 0) or 0)
                        if r.finish_reason not in ("stop", "length"):
                            r.error = r.finish_reason
            elif i < len(pending):
                _sleep_until(t0 + pending[i].arrival_time)
        missing = [k for k in by_id if res.get(k) is None or res[k].finish_time is None]
        for k in missing:  # never drop a request silently
            r = res.setdefault(k, RequestResult(k, t0 + by_id[k].arrival_time, by_id[k].input_len))
            r.error = r.error or "vllm returned no final output"
        end = max([r.finish_time for r in res.values() if r.finish_time is not None] or [now()])
        return BenchRun(self.name, self.model_name, [res[w.request_id] for w in workload.requests], t0, end,
                        self.describe(), stats=self._stats())

    def _stats(self) -> dict:
        m = self.metrics()
        q, h = m.get("vllm:prefix_cache_queries", 0), m.get("vllm:prefix_cache_hits", 0)
        return {"num_blocks_total": self.num_kv_blocks(), "num_preemptions": int(m.get("vllm:num_preemptions", 0)),
                "prefix_cache_hit_rate": (h / q) if q else 0.0,
                "kv_cache_usage_perc": m.get("vllm:kv_cache_usage_perc")}

    def close(self) -> None:
        """Drop the engine (in-process: frees its KV pool once garbage-collected)."""
        import gc

        self.engine = self.llm = None
        gc.collect()


def _external_id(internal: str, prefix: str) -> str:
    """vLLM may append '-<8 random chars>' to the id it was given; map back to the workload's id."""
    rid = internal.removeprefix(prefix)
    return rid


def prometheus_dict(metric_list) -> dict:
    """vLLM's `LLM.get_metrics()` (Counter/Gauge/Histogram/Vector objects) -> plain dict, label sets summed."""
    out: dict = {}
    for m in metric_list:
        kind = type(m).__name__
        if kind == "Histogram":
            h = out.setdefault(m.name, {"count": 0, "sum": 0.0, "buckets": {}})
            h["count"] += m.count
            h["sum"] += m.sum
            for le, c in m.buckets.items():
                h["buckets"][le] = h["buckets"].get(le, 0) + c
        elif kind == "Vector":
            out[m.name] = list(m.values)
        else:
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def histogram_mean(h: dict) -> float:
    return h["sum"] / h["count"] if h and h.get("count") else float("nan")

