"""The engine's fast paths: FlexAttention over the paged cache, and decode CUDA graphs (bucketing, padding).

Flex runs on a CPU (its eager reference), so it is checked here against the readable reference
PagedAttention; graph capture itself needs CUDA, but the padded static-buffer forward it records runs anywhere.
"""
from __future__ import annotations

import random

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.attention import (
    AttentionMetadata,
    paged_attention_reference,
)
from lab_utils.engine.accel.cuda_graphs import (
    DecodeGraphRunner,
    batch_buckets,
    bucket_for,
    context_bucket,
    pad_decode_batch,
    padded_metadata,
    runner_options,
)
from lab_utils.engine.accel.attention_backends import select_attention_backend
from lab_utils.engine.accel.flex_attention import FlexPagedAttention, flex_available
from lab_utils.engine.kv.kv_cache import KVCache

needs_flex = pytest.mark.skipif(not flex_available(), reason="needs torch >= 2.5 (flex_attention)")
# uncompiled flex (the CPU path) warns that it is unfused: expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _ragged_step(seed: int, hq: int, hkv: int, d: int = 16, block_size: int = 4):
    """A random ragged step (prefill chunks and decodes) over a filled cache with shuffled blocks."""
    rng = random.Random(seed)
    B = rng.randint(1, 5)
    ctx = [rng.randint(1, 30) for _ in range(B)]
    qlen = [rng.choice([1, rng.randint(1, c)]) for c in ctx]
    blocks = list(range(64))
    rng.shuffle(blocks)
    tables, i = [], 0
    for c in ctx:
        n = -(-c // block_size)
        tables.append(blocks[i:i + n])
        i += n
    cache = KVCache(1, 64, block_size, hkv, d, torch.float32, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    N = sum(qlen)
    q = torch.randn(1, N, hq, d, generator=g)
    k = torch.randn(1, N, hkv, d, generator=g)
    v = torch.randn(1, N, hkv, d, generator=g)
    return cache, tables, ctx, qlen, block_size, q, k, v


@needs_flex
@pytest.mark.parametrize("seed,hq,hkv", [(0, 4, 2), (1, 6, 2), (2, 3, 3), (3, 8, 1), (4, 9, 3)])
def test_flex_matches_reference_paged_attention(seed, hq, hkv):
    cache, tables, ctx, qlen, bs, q, k, v = _ragged_step(seed, hq, hkv)
    meta = AttentionMetadata.build(tables, ctx, qlen, bs, torch.device("cpu"))
    out = FlexPagedAttention(cache, meta, compiled=False)(0, q, k, v)[0]  # writes k, v into the cache first
    ref = paged_attention_reference(q[0], cache.k[0], cache.v[0], tables, ctx, qlen, bs)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed,hq,hkv", [(10, 4, 2), (11, 9, 3), (12, 2, 1)])
def test_split_attention_matches_reference_on_mixed_steps(seed, hq, hkv):
    from lab_utils.engine.accel.split_attention import SplitMetadata, SplitPagedAttention

    for s in range(seed, seed + 40):  # the first few random steps that mix decodes and prefill chunks
        cache, tables, ctx, qlen, bs, q, k, v = _ragged_step(s, hq, hkv)
        split = SplitMetadata.build(tables, ctx, qlen, bs, torch.device("cpu"))
        if split is None:
            assert all(x == 1 for x in qlen) or all(x > 1 for x in qlen)
            continue
        out = SplitPagedAttention(cache, split)(0, q, k, v)[0]
        ref = paged_attention_reference(q[0], cache.k[0], cache.v[0], tables, ctx, qlen, bs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    pytest.fail("no mixed step drawn")


@pytest.mark.parametrize("group_rows", [1, 2, 3, 8])
def test_decode_rows_attend_in_groups_sorted_by_context(group_rows):
    """Many decodes (+ a prefill chunk or not): groups of <= group_rows decode rows, same result as one pass."""
    from lab_utils.engine.accel.split_attention import SplitMetadata, SplitPagedAttention

    rng = random.Random(group_rows)
    block_size, hq, hkv, d = 4, 6, 2, 16
    for with_prefill in (False, True):
        ctx = [rng.randint(1, 40) for _ in range(11)]
        qlen = [1] * 10 + [rng.randint(2, ctx[-1]) if with_prefill and ctx[-1] > 1 else 1]
        blocks = list(range(200))
        rng.shuffle(blocks)
        tables, i = [], 0
        for c in ctx:
            tables.append(blocks[i:i + -(-c // block_size)])
            i += len(tables[-1])
        cache = KVCache(1, 200, block_size, hkv, d, torch.float32, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(group_rows)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        N = sum(qlen)
        q, k, v = (torch.randn(1, N, h, d, generator=g) for h in (hq, hkv, hkv))
        split = SplitMetadata.build(tables, ctx, qlen, block_size, torch.device("cpu"), group_rows=group_rows)
        assert split is not None
        n_dec = sum(x == 1 for x in qlen)
        assert len(split.groups) == -(-n_dec // group_rows) + (n_dec < len(qlen))
        for rows, meta in split.groups[:-(-n_dec // group_rows)]:  # decode groups: sorted, no more than asked
            assert len(rows) <= group_rows
        dec_ctx = [ctx[r] for rows, _ in split.groups[:-(-n_dec // group_rows)] for r in rows.tolist()]
        assert dec_ctx == sorted(dec_ctx)  # (decode rows' flat index = their entry index: they come first)
        out = SplitPagedAttention(cache, split)(0, q, k, v)[0]
        ref = paged_attention_reference(q[0], cache.k[0], cache.v[0], tables, ctx, qlen, block_size)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert SplitMetadata.build([[0]] * 3, [2, 3, 4], [1, 1, 1], 4, torch.device("cpu"), group_rows=8) is None
    with pytest.raises(ValueError, match="group_rows"):
        SplitMetadata.build([[0]], [2], [1], 4, torch.device("cpu"), group_rows=0)


def test_backend_selection(tiny64):
    cpu, cuda, f32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    assert select_attention_backend("auto", cpu, f32, enforce_eager=False) == "sdpa"
    assert select_attention_backend("auto", cuda, f32, enforce_eager=True) == "sdpa"
    assert select_attention_backend("auto", cuda, f32, enforce_eager=False) == ("flex" if flex_available() else "sdpa")
    with pytest.raises(ValueError, match="invalid"):
        select_attention_backend("no-such-backend", cpu, f32)
    opts = runner_options(EngineConfig(), cpu, tiny64[0], None, 16, 128)
    assert opts == {"attention_backend": "sdpa", "graphs": None}  # CPU: no graphs, no flex


def test_buckets_and_padding():
    assert batch_buckets(1) == (1,) and batch_buckets(16) == (1, 2, 4, 8, 16) and batch_buckets(20)[-1] == 32
    b = batch_buckets(64)
    assert [bucket_for(n, b) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert bucket_for(65, b) is None
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, b)
    assert context_bucket(10, 16, 8192) == 256 and context_bucket(300, 16, 8192) == 512
    assert context_bucket(300, 16, 400) == 400 and context_bucket(100, 16, 40) == 100
    ids, pos, ctx, tables = pad_decode_batch([7, 8, 9], [3, 5, 1], [4, 6, 2], [[0], [1, 2], [3]], 4)
    assert ids == [7, 8, 9, 7] and pos == [3, 5, 1, 3] and ctx == [4, 6, 2, 4] and tables[3] == [0]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_batch([1, 2], [0, 0], [1, 1], [[0], [1]], 1)
    meta = padded_metadata([[0], [1, 2]], [3, 6], 4, 16, torch.device("cpu"))
    assert meta.context_slots.shape == (2, 16) and meta.mask.shape == (2, 1, 1, 16)
    assert meta.mask[0, 0, 0].tolist() == [True] * 3 + [False] * 13  # padded keys are masked out


def test_graph_runner_forward_matches_eager_engine(tiny64):
    """The padded static-buffer decode forward (what a graph records) gives the eager engine's tokens."""
    prompts = [[100 + 13 * i + j for j in range(3 + 2 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    eager = LLMEngine(tiny64, EngineConfig(max_num_seqs=8), device="cpu")
    ref = [o.token_ids for o in eager.generate(prompts, params)]
    eng = LLMEngine(tiny64, EngineConfig(max_num_seqs=8), device="cpu")
    eng.runner.graphs = DecodeGraphRunner(eng.model, eng.kv_cache, eng.block_size, eng.device, 8,
                                          eng.max_model_len, capture=False)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    # float64: padding rows changes the row count, not a row's sums beyond ~1e-15 of a logit; no margin is that thin
    assert got == ref
    assert set(eng.runner.graphs.entries) >= {(8, 256)}  # 5 rows ran in the 8-row bucket
    eng.block_manager.check_all_free()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeGraphRunner(eng.model, eng.kv_cache, 16, torch.device("cpu"), 8, 128, capture=True)


@needs_flex
def test_engine_with_flex_backend_matches_sdpa(tiny64):
    prompts = [[100 + 13 * i + j for j in range(3 + 4 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(tiny64, EngineConfig(), device="cpu").generate(prompts, params)]
    eng = LLMEngine(tiny64, EngineConfig(), device="cpu")
    eng.runner.attention_backend = "flex"
    # float64: flex and SDPA differ by ~1e-15 of a logit, far below any greedy margin: free-running equality holds
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref


# logits of two paths over the same tokens may differ by this share of the largest |logit| (stated, not measured
# on a GPU here): float32 sums in another order, bf16 rounding of every activation
GRAPH_LOGIT_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.02}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_matches_eager():
    """Graphs + flex against eager SDPA, teacher-forced: both engines score the eager run's greedy tokens (each
    step pinned to them), so a near-tie flipped by the other kernels cannot change what is compared later."""
    from lab_utils import load_model
    from lab_utils.checks.teacher_forced import compare, engine_logits_batch, rounding_tie

    model, tok = load_model("smollm2-135m", device="cuda")
    prompts = [[100 + 13 * i + j for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eager = LLMEngine((model, tok), EngineConfig(enforce_eager=True), device="cuda")
    tokens = [o.token_ids for o in eager.generate(prompts, params)]
    ref = engine_logits_batch(eager, prompts, tokens)
    eng = LLMEngine((model, tok), EngineConfig(), device="cuda")
    got = engine_logits_batch(eng, prompts, tokens)
    assert eng.runner.graphs is not None and eng.runner.graphs.num_replays > 0
    assert eng.runner.attention_backend == "flex"
    both = torch.cat(ref)
    agreement = compare(ref, got, tie=rounding_tie(model.dtype, both))
    scale = max(1.0, float(both.abs().max()))
    assert agreement.decisive_fraction == 1.0, f"graphs vs eager ({model.dtype}): {agreement.describe()}"
    assert agreement.max_abs_diff <= GRAPH_LOGIT_TOL[model.dtype] * scale, (
        f"graphs vs eager ({model.dtype}): {agreement.describe()}")


def test_a_failing_fast_path_falls_back_to_eager_loudly():
    """A flex/graph failure on some machine must not lose the step: warn, record, finish on the eager path."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ref = LLMEngine("tiny-random", EngineConfig(num_gpu_blocks=64), device="cpu").generate(["a b c d"], params)
    eng = LLMEngine("tiny-random", EngineConfig(num_gpu_blocks=64), device="cpu")

    class Broken:
        def can_run(self, n: int) -> bool:
            return True

        def run(self, *args):
            raise RuntimeError("graph capture failed")

    eng.runner.graphs = Broken()
    with pytest.warns(UserWarning, match="falling back to eager"):
        out = eng.generate(["a b c d"], params)
    assert out[0].token_ids == ref[0].token_ids
    assert "graph capture failed" in eng.runner.fast_path_error and eng.runner.graphs is None
    eng.block_manager.check_all_free()
