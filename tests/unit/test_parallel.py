"""Tensor and pipeline parallelism across 2 real processes (gloo on CPU) give the single-process greedy tokens.

The model is a small untied random Llama in float64 (see `toy_model`): its greedy tokens depend on the whole
context, and float64 keeps the all-reduce's different summation order from flipping an argmax.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from lab_utils.parallel import run_parallel, split_sizes
from lab_utils.parallel.toy_model import write_toy_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [100, 200, 301, 7, 7]]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return str(write_toy_model(tmp_path_factory.mktemp("toy")))


@pytest.fixture(scope="module")
def single(toy):
    return run_parallel(toy, PROMPTS, max_tokens=8, mode="single", dtype="float64")


def test_single_mode_matches_the_cached_generator(toy, single):
    from lab_utils.models.generate import generate_cached
    from lab_utils.parallel.runner import load_weights_only

    model = load_weights_only(toy, torch.device("cpu"), torch.float64)
    ref = [generate_cached(model, torch.tensor([p]), 8)[0, len(p):].tolist() for p in PROMPTS]
    assert single.token_ids == ref
    assert len(set(map(tuple, ref))) == len(ref) and len(set(ref[0])) > 1, "toy model must not be degenerate"
    assert single.comm_time_s == 0 and single.bytes_communicated == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_two_processes_equal_one(toy, single, mode):
    res = run_parallel(toy, PROMPTS, max_tokens=8, mode=mode, world_size=2, backend="gloo", dtype="float64",
                       timeout_s=240)
    assert res.token_ids == single.token_ids
    assert res.backend == "gloo" and res.world_size == 2
    assert len(res.step_times_s) == 8 * len(PROMPTS)
    assert 0 < res.comm_time_s < sum(res.step_times_s) and 0 < res.comm_share < 1
    assert 0 < res.latency_per_call_s and 0 < res.transfer_time_estimate_s <= res.comm_time_s
    H, layers = 96, 3
    if mode == "tp":  # 2 all-reduces of [1, T, H] per layer per step
        tokens_in = sum(len(p) + 7 for p in PROMPTS)
        assert res.bytes_communicated == 2 * layers * tokens_in * H * 8
    else:  # rank 0 sends [1, T, H] and joins one broadcast of the token per step
        tokens_in = sum(len(p) + 7 for p in PROMPTS)
        assert res.bytes_communicated == tokens_in * H * 8 + 8 * len(res.step_times_s)
    assert multiprocessing.active_children() == []


def test_split_sizes_and_bad_input():
    assert split_sizes(3, 2) == [2, 1] and split_sizes(1536, 2) == [768, 768]
    with pytest.raises(ValueError, match="mode"):
        run_parallel("tiny-random", [[1, 2]], mode="dp")
    with pytest.raises(ValueError, match="world_size"):
        run_parallel("tiny-random", [[1, 2]], mode="tp", world_size=1)
    with pytest.raises(ValueError, match="nccl"):
        run_parallel("tiny-random", [[1, 2]], mode="tp", backend="nccl", device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs CUDA (2 GPUs)")
def test_nccl_tensor_parallel_matches_single(toy):
    ref = run_parallel(toy, PROMPTS, max_tokens=8, mode="single", device="cuda", dtype="float64")
    res = run_parallel(toy, PROMPTS, max_tokens=8, mode="tp", world_size=2, device="cuda", dtype="float64")
    assert res.backend == "nccl" and res.token_ids == ref.token_ids
