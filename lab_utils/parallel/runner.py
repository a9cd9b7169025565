"""What every rank runs: load the model, keep its shard, greedy-generate each prompt, time every step.

The same loop serves all modes, so outputs and timings are comparable: `single` (the whole model, no
communication), `tp` (tensor-parallel shard, all-reduces inside the layers), `pp` (a pipeline stage, send/recv
between stages). Prompts run one after another with batch 1 and a `SimpleKVCache` sized for this rank's heads.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from lab_utils.models.kv_cache_simple import SimpleKVCache
from lab_utils.parallel.comm import Comm
from lab_utils.parallel.pipeline_parallel import PipelineStage
from lab_utils.parallel.tensor_parallel import load_tp_parts, shard_llama

MODES = ("single", "tp", "pp")


@dataclass
class RankResult:
    rank: int
    token_ids: list[list[int]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    total_time_s: float = 0.0
    comm_time_s: float = 0.0
    bytes_communicated: int = 0
    comm_calls: int = 0
    load_time_s: float = 0.0
    latency_per_call_s: float = 0.0  # one decode-sized message with both ranks ready (see `calibrate`)
    learner_parts: list[str] = field(default_factory=list)  # the learner's parts this rank ran (TP)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_weights_only(name: str, device: torch.device, dtype: torch.dtype):
    """`load_model` without the tokenizer: importing `transformers` costs a worker ~10 s of start-up on a busy
    machine, and ranks and engine workers only ever see token ids."""
    from lab_utils.models.llama import LlamaForCausalLM, rope_inv_freq
    from lab_utils.models.loader import (
        build_random,
        load_config,
        load_weights,
        model_folder,
    )
    from lab_utils.models.registry import lookup

    spec, _ = lookup(str(name))
    if spec is not None and spec.kind == "random":
        model = build_random(spec.config)
    else:
        folder = model_folder(str(name))
        with torch.device("meta"):  # no random init of weights about to be overwritten
            model = LlamaForCausalLM(load_config(folder))
        model = model.to_empty(device="cpu")
        load_weights(model, folder)
        if model.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    c = model.config
    model.model.rotary_emb.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)
    model.name = str(name)
    return model


@torch.inference_mode()
def run_rank(model_name: str, prompts: list[list[int]], max_tokens: int, mode: str, comm: Comm,
             dtype: torch.dtype, learner_parts=()) -> RankResult:
    t0 = time.perf_counter()
    used: list[str] = []
    model = load_weights_only(model_name, comm.device, dtype)
    cfg = model.config
    kv_heads, stage = cfg.num_key_value_heads, None
    if mode == "tp":
        shard_fn, row_fn, used = load_tp_parts(learner_parts)
        shard_llama(model, comm, shard_fn, row_fn)
        kv_heads = model.local_kv_heads
    elif mode == "pp":
        stage = PipelineStage(model, comm)
    out = RankResult(comm.rank, load_time_s=time.perf_counter() - t0, learner_parts=used)
    comm.reset()  # count only generation traffic
    t_start = time.perf_counter()
    for prompt in prompts:
        cache = SimpleKVCache(cfg.num_hidden_layers, 1, len(prompt) + max_tokens, kv_heads, cfg.head_dim,
                              model.dtype, comm.device)
        ids = torch.tensor([prompt], dtype=torch.long, device=comm.device)
        gen: list[int] = []
        for _ in range(max_tokens):
            _sync(comm.device)
            ts = time.perf_counter()
            positions = cache.positions(ids.shape[1])
            if stage is not None:
                tok = stage.step(ids, positions, cache)
            else:
                hidden = model.hidden_states(ids, positions, attention=cache)
                tok = int(model.logits(hidden[:, -1:])[0, -1].argmax())
            cache.advance(ids.shape[1])
            _sync(comm.device)
            out.step_times_s.append(time.perf_counter() - ts)
            gen.append(tok)
            ids = torch.tensor([[tok]], dtype=torch.long, device=comm.device)
        out.token_ids.append(gen)
    out.total_time_s = time.perf_counter() - t_start
    out.comm_time_s, out.bytes_communicated, out.comm_calls = comm.seconds, comm.bytes, comm.calls
    if comm.world_size > 1:
        out.latency_per_call_s = calibrate(comm, mode, cfg.hidden_size, model.dtype)
    return out


def calibrate(comm: Comm, mode: str, hidden: int, dtype: torch.dtype, repeat: int = 30) -> float:
    """Median seconds of one decode-sized message ([1, 1, hidden]) when both ranks are already waiting for it.

    Time inside a collective during generation also holds the wait for the slower rank (load imbalance, the
    other stage's compute in a pipeline, a core taken by another job); this is the transfer alone, so
    `calls x latency` estimates the wire share and the rest of `comm_time_s` is waiting."""
    import torch.distributed as dist

    x = torch.zeros(1, 1, hidden, dtype=dtype, device=comm.device)
    times = []
    for _ in range(repeat):
        dist.barrier()
        _sync(comm.device)
        t0 = time.perf_counter()
        if mode == "tp":
            dist.all_reduce(x)
        elif comm.rank == 0:  # ping-pong between the first two stages; half a round trip
            dist.send(x, 1)
            dist.recv(x, 1)
        elif comm.rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        _sync(comm.device)
        times.append((time.perf_counter() - t0) / (1 if mode == "tp" else 2))
    return statistics.median(times)
