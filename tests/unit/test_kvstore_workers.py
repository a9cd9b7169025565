"""Two prefill workers in their own processes sharing one KV store: a prompt routed to the worker that did not
compute its prefix still skips that prefill; without the store it is computed again, to the same first token."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils import EngineConfig
from lab_utils.engine.kv.paging import bytes_per_token
from lab_utils.disagg.router import load_tokenizer_for

pytestmark = pytest.mark.slow

CFG = EngineConfig(num_gpu_blocks=64, block_size=16, enable_prefix_caching=True, max_num_seqs=2)
FIRST = ("System: you answer questions about serving language models. Keep answers short. "
         "User: what does a paged KV cache save? Assistant: memory lost to fragmentation. ") * 2


def test_the_other_worker_reads_the_prefix_from_the_store():
    from lab_utils.kvstore.workers import PrefillWorkers

    tok = load_tokenizer_for("smollm2-135m")
    turn1 = tok.encode(FIRST)
    turn2 = turn1 + tok.encode(" User: and prefix caching?")
    n_full = len(turn1) // 16
    with PrefillWorkers("smollm2-135m", CFG, n=2) as pool:
        a = pool.prefill(0, turn1)
        b = pool.prefill(1, turn2)  # the other worker: it never saw turn 1
    with PrefillWorkers("smollm2-135m", CFG, n=2, use_store=False) as apart:
        apart.prefill(0, turn1)
        c = apart.prefill(1, turn2)
    assert a["num_cached_tokens"] == 0 and a["blocks_to_store"] == n_full
    assert b["num_cached_tokens"] == n_full * 16 and b["blocks_from_store"] == n_full
    assert b["store_bytes_in"] == n_full * 16 * bytes_per_token(30, 3, 64, torch.float32)  # SmolLM2-135M, fp32
    assert c["num_cached_tokens"] == 0  # without the store, worker 1 computes turn 1 again
    assert b["first_token"] == c["first_token"]  # the same answer either way


def test_workers_need_the_prefix_cache():
    from lab_utils.kvstore.workers import PrefillWorkers

    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        PrefillWorkers("smollm2-135m", EngineConfig(enable_prefix_caching=False))
