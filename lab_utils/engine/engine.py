"""LLMEngine: add requests, call step() until done.

Each step: the scheduler picks requests and token counts (`scheduler.py`, `scheduling/`), the step hooks plan
(`hooks.py`: speculative guesses, grammar masks; `features.py` builds them), the model runs on the paged KV
cache (`model_runner.py`), the hooks mask the logits, tokens are picked (`sampler.py`, or a verify hook), full
blocks join the prefix cache, and each request appends its tokens until a stop condition ends it.
A learner's parts replace the reference ones through `parts=` (`replaceable.py`)."""
from __future__ import annotations

import functools
import itertools
import numbers
from typing import Iterable, Sequence

import torch

from lab_utils.device import now, resolve_device
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.features import STATS_WHEN_OFF, build_hooks
from lab_utils.engine.hooks import StepBatch
from lab_utils.engine.kv.host_tier import host_tier_for
from lab_utils.engine.kv.tier import STATS_WHEN_OFF as TIER_STATS_WHEN_OFF, attach_tier, prefetch_prompt
from lab_utils.engine.accel import FastPaths, fast_linears, warmup_shapes
from lab_utils.engine.kv.kv_cache import KVCache, fp8_decode, fp8_encode, storage_dtype
from lab_utils.engine.model_runner import ModelRunner
from lab_utils.engine.replaceable import REFERENCE, Parts
from lab_utils.engine.kv.paging import bytes_per_token
from lab_utils.engine.request import Request, RequestOutput, Status
from lab_utils.engine.logprobs import record_prompt_logprobs, sampled_logprobs
from lab_utils.engine.sampler import apply_logit_processors, sample
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB of KV on a CPU unless told otherwise


def stop_reason(req: Request, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
    """Why `req` ends now that `token` is its newest token (already appended), or None: "stop" for an end
    token (unless `ignore_eos`) or one of its `stop_token_ids`; "length" at `max_tokens` output tokens or when
    the sequence fills `max_model_len`. (Stop strings are checked by the engine on the decoded text.)"""
    p = req.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def quantizers(parts: Parts) -> dict:
    """Lab 05's parts as `quantize_model`'s keyword arguments: the learner's arithmetic, or None for its own.
    Every quantized model the engine builds (its weights, a quantized self-draft) goes through these."""
    return {"quantize_int8": parts.function("quant.quantize_per_channel_int8", None),
            "quantize_int4": parts.function("quant.quantize_per_group_int4", None),
            "dequantize_int4": parts.function("quant.dequantize_int4", None)}


class LLMEngine:
    def __init__(self, model="smollm2-135m", config: EngineConfig | None = None, device: str = "auto",
                 dtype: torch.dtype | None = None, tokenizer=None, parts: Parts | None = None) -> None:
        self.config = config = config or EngineConfig()
        # which version of each teachable part runs: the reference, or a learner's (lab_utils.course.parts)
        self.parts = parts if parts is not None else REFERENCE
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # graph capture and the default stream follow the *current* device: make it this engine's
            torch.cuda.set_device(self.device)
        owned = isinstance(model, str) or hasattr(model, "__fspath__")
        if owned:
            from lab_utils.models.loader import load_model

            model, tokenizer = load_model(str(model), device=self.device, dtype=dtype)
        elif isinstance(model, tuple):
            model, tokenizer = model
        if config.quantization is not None:
            import copy

            from lab_utils.quant.linear import quantize_model

            # weight-only INT8/INT4 linears; a model passed in by the caller is copied, never changed under them
            model, self.quantization_bytes_saved = quantize_model(model if owned else copy.deepcopy(model),
                                                                  config.quantization, **quantizers(self.parts))
        self.model, self.tokenizer = model, tokenizer
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        config.check_against_model(self.max_model_len)
        store = storage_dtype(config.kv_cache_dtype, model.dtype)
        self.bytes_per_token = bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, store)
        # contiguous layout = one block per sequence, as long as the longest sequence (the pre-paging way)
        contiguous = config.kv_layout == "contiguous"
        self.block_size = -(-self.max_model_len // config.block_size) * config.block_size if contiguous else config.block_size
        self.bytes_per_block = self.bytes_per_token * self.block_size
        self.num_blocks = self._num_blocks()
        self.kv_cache = KVCache(mc.num_hidden_layers, self.num_blocks, self.block_size, mc.num_key_value_heads,
                                mc.head_dim, model.dtype, store, self.device,
                                fp8_codec=(self.parts.function("kv_cache.fp8_encode", fp8_encode),
                                           self.parts.function("kv_cache.fp8_decode", fp8_decode)))  # lab 05
        self.block_manager = self.parts.subclass(BlockManager, "block_manager")(
            self.num_blocks, self.block_size, config.enable_prefix_caching and not contiguous, config.watermark)
        tier = host_tier_for(config, self.kv_cache)  # None without kv_offload_bytes
        if tier is not None:
            attach_tier(self.block_manager, tier, self.parts, "kv_offload_bytes (the host KV tier)")
        # the swap hooks hold the KV cache, not the engine: bound methods would make engine -> scheduler -> engine
        # a reference cycle, and an engine in a cycle (KV pool included) outlives `del engine` until a full gc
        self.scheduler = self.parts.subclass(Scheduler, "scheduler")(
            config, self.block_manager, functools.partial(swap_out, self.kv_cache),
            functools.partial(swap_in, self.kv_cache))
        fast_paths = FastPaths.for_engine(config, self.device, model, self.kv_cache, self.block_size, self.max_model_len)
        self.runner = ModelRunner(fast_linears(model, self.device, config), self.kv_cache, self.block_size, self.device,
                                  fast_paths, slot_mapping=self.parts.function("attention.slot_mapping", None))
        self.eos_ids = self._eos_ids()
        self._stop_fn = self.parts.function("engine.stop_reason", stop_reason)  # lab 01: when a request is done
        # the features that join every step (speculative decoding, structured output): `self.spec`,
        # `self.structured`, and the hooks the step calls (features.py names them; a new one is appended there)
        self.hooks = build_hooks(self)
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_finished = self.num_aborted = self.num_rejected = 0
        self.step_log: list[dict] = []  # per step: time, scheduled request ids and token counts (timelines)
        # a long-running server turns this off: no step_log, and ended requests are forgotten once reported
        self.keep_history = True
        self.closed = False

    # -- sizing -----------------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":  # vLLM's meaning: a share of the card for weights + activations + KV
                from lab_utils.engine.kv.kv_budget import kv_cache_budget, measure

                tokens = min(cfg.max_num_batched_tokens, self.max_model_len)
                budget = kv_cache_budget(measure(self.model, self.device, tokens, min(cfg.max_num_seqs, tokens)),
                                         cfg.gpu_memory_utilization)
            else:
                budget = CPU_DEFAULT_KV_BYTES
        n = budget // self.bytes_per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block: one block of {self.block_size} tokens needs "
                f"{self.bytes_per_block} bytes (2 x layers x block_size x kv_heads x head_dim x dtype bytes)"
            )
        return int(n)

    def _eos_ids(self) -> set[int]:
        eos = self.model.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request. Returns its id. A request that can never run is rejected with a reason, not dropped."""
        self._check_open()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            token_ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
            text = prompt
        else:
            token_ids, text = self._token_ids(prompt), None
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        outside = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token id {outside[0]}, outside this model's vocabulary: token ids "
                             f"must be in [0, {self.vocab_size})")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        states = self.hooks.validate(params)  # e.g. a bad schema: ValueError, nothing queued
        req = Request(rid, text, token_ids, params, arrival_time if arrival_time is not None else now())
        self.requests[rid] = req
        reason = self._rejection_reason(req)
        if reason:
            req.status, req.finish_reason = Status.REJECTED, f"rejected: {reason}"
            self.num_rejected += 1
            self._pending_outputs.append(self._output(req, finished=True))
        else:
            self.hooks.add(rid, states)
            self.scheduler.add(req)
            if self.config.kv_offload_prefetch:
                prefetch_prompt(self.block_manager, req)  # e.g. its blocks on disk, read ahead on a thread
        return rid

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: a token id outside [0, vocab_size) would fail inside a step."""
        return int(self.model.config.vocab_size)

    def _token_ids(self, prompt: Iterable[int]) -> list[int]:
        """Checked prompt ids: a bad id fails here, at the caller, never in a step shared with other requests."""
        try:
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        except TypeError:
            raise ValueError(f"prompt must be text or a sequence of token ids, not {type(prompt).__name__}") from None
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"prompt[{i}]={t!r} is not a token id: token ids are ints in [0, {vocab})")
            ids[i] = t = int(t)
            if not 0 <= t < vocab:
                raise ValueError(f"prompt[{i}]={t} is outside this model's vocabulary: token ids must be in "
                                 f"[0, {vocab})")
        return ids

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """Why a request of this size could never run here (None if it can): callers may ask before adding."""
        if num_prompt_tokens >= self.max_model_len:
            return (f"prompt has {num_prompt_tokens} tokens but max_model_len is {self.max_model_len} "
                    f"(prompt + at least one generated token must fit)")
        # the whole request (prompt + max_tokens) must fit in the pool on its own, else preemption cannot help
        longest = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        need = self.block_manager.blocks_needed(longest)
        if need > self.num_blocks:
            return (f"prompt + max_tokens ({longest} tokens) needs {need} KV blocks but the pool has only "
                    f"{self.num_blocks}; lower max_tokens, or raise kv_cache_memory_bytes or num_gpu_blocks")
        return None

    def _rejection_reason(self, req: Request) -> str | None:
        return self.check_request(req.num_prompt_tokens, req.params)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request now and free its blocks. Returns False if it had already ended. `reason` becomes its
        finish_reason ("abort" when a client left; "error: ..." when a step failed on it)."""
        req = self.requests.get(request_id)
        if req is None or req.status.done:
            return False
        self.scheduler.finish(req, Status.ABORTED)
        req.finish_reason = reason
        req.metrics.finish_time = now()
        self.num_aborted += 1
        self.hooks.release(request_id)
        if self.block_manager.host_tier is not None:
            self.block_manager.host_tier.release(request_id)  # what was read ahead for it
        self._pending_outputs.append(self._output(req, finished=True))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # -- the serving API --------------------------------------------------------------------------
    # What a server that drives step() from its own loop needs (lab_utils/server/async_engine.py, the decode
    # worker of lab_utils/disagg): it reads and moves requests through these, never through the scheduler.
    @property
    def num_waiting(self) -> int:
        """Requests queued for a step: new ones, and those a preemption sent back."""
        return len(self.scheduler.waiting)

    def pending_outputs(self) -> list[RequestOutput]:
        """A copy of the outputs the next step() returns first (aborts, rejections since the last step). A step
        that raises has taken them already: its caller delivers this copy, made before the step, instead."""
        return list(self._pending_outputs)

    def take_pending_outputs(self) -> list[RequestOutput]:
        """The outputs waiting for the next step() (aborts, rejections), handed over now, without a step."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def requests_in_step(self) -> list[Request]:
        """The requests a step works on: the running ones, or, when none runs, the head of the queue (the one
        being admitted). After a step raised, these are the ones it may have failed on."""
        running = [r for r in self.scheduler.running if not r.status.done]
        return running or list(self.scheduler.waiting)[:1]

    def set_aside(self, request_id: str) -> Request:
        """Take an unfinished request out of scheduling and drop its KV (a step that failed may have left it
        half-written; it is recomputed on `resume`, as after a recompute preemption). It stays unfinished, in
        no queue, until `resume` or `abort`."""
        req = self.requests[request_id]
        sched = self.scheduler
        if req in sched.running:
            sched.running.remove(req)
        elif req in sched.waiting:
            sched.waiting.remove(req)
        self.block_manager.free(req)
        req.swapped_kv = None
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        return req

    def resume(self, request_id: str) -> bool:
        """Put a request from `set_aside` back at the head of the queue. False if it ended meanwhile."""
        req = self.requests.get(request_id)
        if req is None or req.status.done:
            return False
        if req in self.scheduler.running or req in self.scheduler.waiting:
            raise ValueError(f"request {request_id!r} is already scheduled: only a set-aside request resumes")
        self.scheduler.waiting.appendleft(req)
        return True

    def admit(self, req: Request) -> str:
        """Queue a Request built elsewhere, progress included (the decode side of disaggregated serving: its
        prompt's KV and first token came from another engine). One that can never run here is rejected with a
        reason, as in `add_request`. Returns its id."""
        self.requests[req.request_id] = req
        reason = self._rejection_reason(req)
        if reason:
            req.status, req.finish_reason, req.swapped_kv = Status.REJECTED, f"rejected: {reason}", None
            self.num_rejected += 1
            self._pending_outputs.append(self._output(req, finished=True))
        else:
            self.scheduler.add(req)
        return req.request_id

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> plan (hooks) -> run the model -> mask (hooks) -> pick tokens (sample, or a
        hook's verify) -> commit full blocks -> append tokens and check stops. Returns an output for every
        request that produced a token or ended in this step (streaming clients read `new_token_ids`)."""
        self._check_open()
        outputs = self.take_pending_outputs()  # aborts and rejections since the last step
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._check_progress()
            return outputs
        batch = self._begin(sched)
        self.hooks.plan(batch)  # e.g. speculative guesses; grammar masks start filling
        self._forward(batch)
        tokens = self._pick_tokens(batch)
        for req, _ in batch.scheduled:
            self.block_manager.commit_full_blocks(req)  # after any rollback: only verified tokens are shared
        outputs += self._append(batch, tokens)
        self._log_step(batch, sched)
        return outputs

    def _begin(self, sched: SchedulerOutput) -> StepBatch:
        t_start = now()
        for req, _ in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t_start
        return StepBatch(sched.scheduled, sched.num_padding,
                         self.config.max_num_batched_tokens - sched.num_tokens, t_start)

    def _forward(self, batch: StepBatch) -> None:
        """Run the model on the batch; the hooks then mask the logits of the requests that pick tokens."""
        batch.logits, batch.to_sample = self.runner.run(batch.scheduled, batch.num_padding, batch.rows)
        batch.hidden = self.runner.last_hidden
        self.hooks.mask(batch)  # e.g. forbidden tokens of grammar-constrained rows -> -inf
        if self.runner.last_prompt_hidden:  # requests that asked for their prompt's logprobs
            record_prompt_logprobs(self.runner.model, self.runner.last_prompt_hidden)

    def _pick_tokens(self, batch: StepBatch) -> list[tuple[list[int], list | None]]:
        """Per request that samples: the tokens it appends (one, or a verify step's accepted guesses + one) and
        their logprobs when asked for."""
        rows = batch.sampled_rows()
        batch.logits = apply_logit_processors(batch.logits, batch.to_sample, self.eos_ids, rows)  # rows that ask
        for req, n in batch.scheduled:
            req.num_computed_tokens += n
        tokens = self.hooks.pick(batch)  # a verify step rolls its rejected guesses back here
        if tokens is None:
            to_sample = batch.to_sample
            toks = sample(batch.logits, [r.params for r in to_sample], [r.generator for r in to_sample]) \
                if to_sample else []
            tokens = [[tok] for tok in toks]
        logprobs = sampled_logprobs(batch.logits, batch.to_sample, tokens, rows)  # None: did not ask
        return list(zip(tokens, logprobs))

    def _append(self, batch: StepBatch, picked: list[tuple[list[int], list | None]]) -> list[RequestOutput]:
        """Append each request's new tokens, stopping at the first that ends it; finish the ended requests."""
        outputs = []
        t = now()
        for req, (toks, lps) in zip(batch.to_sample, picked):
            reason, emitted = None, []
            for i, tok in enumerate(toks):  # several tokens after a verify step; stop conditions truncate the chain
                req.token_ids.append(tok)
                if lps is not None:
                    req.logprobs.append(lps[i])
                req.metrics.token_times.append(t)
                emitted.append(tok)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = t
                reason = self.hooks.accept(req, tok) or self._stop_reason(req, tok)
                if reason:
                    break
            if reason:
                self.scheduler.finish(req, Status.FINISHED)
                req.finish_reason, req.metrics.finish_time = reason, t
                self.num_finished += 1
                self.hooks.release(req.request_id)
            outputs.append(self._output(req, finished=reason is not None, new=emitted))
        batch.end = t
        return outputs

    def _log_step(self, batch: StepBatch, sched: SchedulerOutput) -> None:
        self.num_steps += 1
        if self.keep_history:
            self.step_log.append({
                "step": self.num_steps, "start": batch.start, "end": batch.end,
                "requests": [(r.request_id, n) for r, n in batch.scheduled],
                "num_tokens": sched.num_tokens, "preempted": [r.request_id for r in sched.preempted],
                "free_blocks": self.block_manager.num_free_blocks,
                "num_padding": sched.num_padding,  # static batching: finished members computed as padding
            })

    def _check_progress(self) -> None:
        """A step that scheduled nothing while requests wait is a stall: a bug, or a learner's part that keeps
        blocks (the course's parts say which, `EngineParts.stall_error`)."""
        if not self.scheduler.has_work():
            return
        stuck = ([r for r in self.scheduler.running if not r.status.done] or list(self.scheduler.waiting))[0]
        error = self.parts.stall_error(self, stuck) if self.parts else None
        raise error or RuntimeError(f"scheduler made no progress with {stuck}; this is a bug")

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        reason = self._stop_fn(req, tok, self.eos_ids, self.max_model_len)
        if reason != "stop" and p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(req.output_token_ids[-16:])
            if any(s in tail for s in p.stop):
                return "stop"
        return reason

    def _output(self, req: Request, finished: bool, new: list[int] | None = None) -> RequestOutput:
        if finished and not self.keep_history:
            self.requests.pop(req.request_id, None)
        text = ""
        if finished and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            for s in req.params.stop:
                if s in text:
                    text = text[:text.index(s)]
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.output_token_ids, text,
                            finished, req.finish_reason, req.metrics, req.num_cached_tokens, new or [])
        if req.logprobs is not None:
            out.new_logprobs = req.logprobs[len(req.logprobs) - len(out.new_token_ids):]
            out.logprobs = list(req.logprobs) if finished else None
        if req.prompt_logprobs is not None and (finished or req.num_output_tokens == len(out.new_token_ids)):
            out.prompt_logprobs = list(req.prompt_logprobs)
        return out

    # -- warm-up ------------------------------------------------------------------------------------
    def can_warm_up(self) -> bool:
        """True while no KV block is in use or cached (warm-up's dummy steps write into the pool)."""
        bm = self.block_manager
        return not self.scheduler.has_work() and bm.num_free_blocks == bm.num_blocks and not bm.num_cached_blocks

    def warmup(self, max_batch: int | None = None, max_context: int | None = None, prefill_len: int = 16) -> dict:
        """Compile (flex) and capture (CUDA graphs) the shapes a run will use, before its first measured request,
        as vLLM does at start-up: every graph batch bucket up to `max_batch` (default `max_num_seqs`) at every
        context bucket up to `max_context` (default: the first bucket). Without it the first step of each new
        batch size pays a capture (and the first steps a compilation) inside the measurement.

        Call it on a fresh engine (see `can_warm_up`). Returns {"steps", "graphs", "seconds", ...}."""
        self._check_open()
        if not self.can_warm_up():
            raise RuntimeError("warmup() needs a fresh engine (no request running, no block in use or cached): "
                               "call it right after building the engine")
        max_batch = min(max_batch or self.config.max_num_seqs, self.config.max_num_seqs)
        batches, contexts = warmup_shapes(self.runner.fast_paths, max_batch, max_context, self.block_size,
                                          self.max_model_len)
        return self.runner.warmup(batches, contexts, prefill_len, self.num_blocks)

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Give the KV pool and the captured CUDA graphs back now (to the card, on a GPU), as vLLM's shutdown.

        `del engine` frees them too once the last reference goes; `close()` does it even while a notebook still
        holds the engine. A closed engine refuses new work with a clear error."""
        self.closed = True
        self.runner.graphs = None
        if self.block_manager.host_tier is not None:
            self.block_manager.host_tier.close()  # read-aheads finished, entries dropped, a disk tier's files removed
        empty = torch.empty(0, device=self.device)
        for name in ("k", "v", "k_scale", "v_scale"):
            if hasattr(self.kv_cache, name):
                setattr(self.kv_cache, name, empty)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLMEngine was closed (close() freed its KV cache); build a new engine")

    # -- convenience ------------------------------------------------------------------------------
    def generate(self, prompts: str | Iterable[str | Sequence[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        while self.has_unfinished() and len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids and out.request_id not in done:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_blocks_total": bm.num_blocks,
            "num_blocks_free": bm.num_free_blocks,
            "num_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "kv_capacity_tokens": bm.num_blocks * self.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": bm.hit_rate(),
            "num_cached_blocks": bm.num_cached_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": len(self.scheduler.waiting),
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_rejected": self.num_rejected,
            "num_steps": self.num_steps,
            **STATS_WHEN_OFF, **self.hooks.stats(),
            **TIER_STATS_WHEN_OFF, **(bm.host_tier.stats() if bm.host_tier is not None else {}),
        }


def swap_out(kv_cache: KVCache, req: Request) -> None:
    """Swap preemption: copy a request's KV to host memory (the scheduler keeps its computed tokens)."""
    req.swapped_kv = kv_cache.copy_out(req.block_table)


def swap_in(kv_cache: KVCache, req: Request) -> None:
    kv_cache.copy_in(req.block_table, req.swapped_kv)
    req.swapped_kv = None


def copy_block_out(kv_cache: KVCache, block_id: int) -> dict[str, torch.Tensor]:
    """The host tier's copy of one block's K/V (every layer; an int8 cache's scales too)."""
    return kv_cache.copy_out([block_id])


def copy_block_in(kv_cache: KVCache, block_id: int, saved: dict[str, torch.Tensor]) -> None:
    kv_cache.copy_in([block_id], saved)
