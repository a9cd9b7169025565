"""Paged attention equals dense attention, and the block manager's bookkeeping is exact.

Attention: K/V are scattered over a pool of blocks in a random physical order; both the per-sequence reference
(`paged_attention_reference`) and the engine's batched path (`AttentionMetadata` + `PagedAttention`) must give
what dense causal attention over the same tokens gives, within 1e-4 in fp32: ragged lengths, decodes, chunked
queries over a cached prefix, grouped-query attention.
Block manager: reference counts, the chained prefix hash, the collision guard, LRU eviction, the watermark.
"""
from __future__ import annotations

import random

import pytest
import torch

from lab_utils.engine.kv import prefix_cache
from lab_utils.engine.attention import AttentionMetadata, PagedAttention, gather_blocks, paged_attention_reference
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.prefix_cache import block_hash
from lab_utils.engine.request import Request
from lab_utils.engine.sampling_params import SamplingParams

ATOL = RTOL = 1e-4


# --- attention -----------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Q, Hq, D] are the last Q positions of a sequence whose keys/values are k, v [L, Hkv, D]; float64."""
    Q, Hq, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    k = k.double().repeat_interleave(Hq // Hkv, dim=1)
    v = v.double().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / D ** 0.5
    qpos = torch.arange(L - Q, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(seed: int, context_lens: list[int], query_lens: list[int], hq: int, hkv: int, d: int,
              block_size: int, spare_blocks: int = 3):
    """Random K/V for every sequence, scattered over shuffled physical blocks; returns everything a test needs."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # physical blocks in no particular order: the block table is the only map
    tables, pos = [], 0
    for n in need:
        tables.append(ids[pos:pos + n])
        pos += n
    ks = [torch.randn(c, hkv, d, generator=g) for c in context_lens]
    vs = [torch.randn(c, hkv, d, generator=g) for c in context_lens]
    qs = [torch.randn(ql, hq, d, generator=g) for ql in query_lens]
    return tables, ks, vs, qs, num_blocks


def slots_of(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    return [table[t // block_size] * block_size + t % block_size for t in range(start, stop)]


CASES = [
    # context_lens, query_lens, Hq, Hkv, D, block_size
    pytest.param([5, 17, 33, 1], [5, 17, 33, 1], 4, 4, 16, 4, id="prefill-ragged-mha"),
    pytest.param([9, 40, 16, 3], [1, 1, 1, 1], 8, 2, 32, 8, id="decode-ragged-gqa4"),
    pytest.param([50, 23, 64], [7, 23, 1], 6, 3, 8, 16, id="chunk-over-cached-prefix-gqa2"),
    pytest.param([100, 2, 31, 77, 16], [16, 2, 1, 30, 16], 9, 3, 64, 16, id="mixed-step-smollm2-heads"),
    pytest.param([1], [1], 2, 1, 4, 1, id="single-token-block-size-1"),
    pytest.param([129], [64], 4, 1, 16, 32, id="long-chunk-mqa"),
]


@pytest.mark.parametrize("context_lens,query_lens,hq,hkv,d,bs", CASES)
def test_reference_paged_attention_equals_dense(context_lens, query_lens, hq, hkv, d, bs):
    tables, ks, vs, qs, num_blocks = make_case(1, context_lens, query_lens, hq, hkv, d, bs)
    k_cache = torch.zeros(num_blocks * bs, hkv, d)
    v_cache = torch.zeros(num_blocks * bs, hkv, d)
    for table, k, v in zip(tables, ks, vs):
        s = torch.tensor(slots_of(table, 0, k.shape[0], bs))
        k_cache[s], v_cache[s] = k, v
    got = paged_attention_reference(torch.cat(qs), k_cache, v_cache, tables, context_lens, query_lens, bs)
    want = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, ks, vs)]).float()
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("context_lens,query_lens,hq,hkv,d,bs", CASES)
def test_batched_paged_attention_equals_dense(context_lens, query_lens, hq, hkv, d, bs):
    """The engine's path: the cached prefix is already in the pool; this step's K/V are written through the slot
    mapping by PagedAttention itself, then every sequence reads its context through its block table."""
    tables, ks, vs, qs, num_blocks = make_case(2, context_lens, query_lens, hq, hkv, d, bs)
    cache = KVCache(2, num_blocks, bs, hkv, d, torch.float32, torch.float32, torch.device("cpu"))
    layer = 1  # not layer 0, so a layer mix-up shows
    new_k, new_v = [], []
    for table, k, v, ql in zip(tables, ks, vs, query_lens):
        ctx = k.shape[0]
        s = torch.tensor(slots_of(table, 0, ctx - ql, bs), dtype=torch.long)
        cache.write(layer, s, k[:ctx - ql], v[:ctx - ql])
        new_k.append(k[ctx - ql:])
        new_v.append(v[ctx - ql:])
    meta = AttentionMetadata.build(tables, context_lens, query_lens, bs, torch.device("cpu"))
    assert meta.decode_only == (max(query_lens) == 1)
    expected_slots = [s for t, c, ql in zip(tables, context_lens, query_lens) for s in slots_of(t, c - ql, c, bs)]
    assert meta.slot_mapping.tolist() == expected_slots
    got = PagedAttention(cache, meta)(layer, torch.cat(qs)[None], torch.cat(new_k)[None], torch.cat(new_v)[None])[0]
    want = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, ks, vs)]).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the new tokens really landed in the pool where the block tables say
    for table, k in zip(tables, ks):
        torch.testing.assert_close(gather_blocks(cache.k[layer], table, k.shape[0], bs), k)


@pytest.mark.parametrize("seed", range(8))
def test_paged_attention_random_shapes(seed):
    """Fresh random batches: ragged contexts, random chunk sizes, GQA ratios 1..4, block sizes 1..32."""
    rng = random.Random(100 + seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 4])
    d = rng.choice([8, 16, 32])
    bs = rng.choice([1, 2, 4, 8, 16, 32])
    B = rng.randint(1, 6)
    context_lens = [rng.randint(1, 90) for _ in range(B)]
    query_lens = [rng.choice([1, c, rng.randint(1, c)]) for c in context_lens]
    tables, ks, vs, qs, num_blocks = make_case(seed, context_lens, query_lens, hq, hkv, d, bs)
    want = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, ks, vs)]).float()

    cache = KVCache(1, num_blocks, bs, hkv, d, torch.float32, torch.float32, torch.device("cpu"))
    for table, k, v, ql in zip(tables, ks, vs, query_lens):
        s = torch.tensor(slots_of(table, 0, k.shape[0] - ql, bs), dtype=torch.long)
        cache.write(0, s, k[:k.shape[0] - ql], v[:k.shape[0] - ql])
    meta = AttentionMetadata.build(tables, context_lens, query_lens, bs, torch.device("cpu"))
    new_k = torch.cat([k[k.shape[0] - ql:] for k, ql in zip(ks, query_lens)])
    new_v = torch.cat([v[v.shape[0] - ql:] for v, ql in zip(vs, query_lens)])
    batched = PagedAttention(cache, meta)(0, torch.cat(qs)[None], new_k[None], new_v[None])[0]
    torch.testing.assert_close(batched, want, atol=ATOL, rtol=RTOL)
    ref = paged_attention_reference(torch.cat(qs), cache.k[0], cache.v[0], tables, context_lens, query_lens, bs)
    torch.testing.assert_close(ref, want, atol=ATOL, rtol=RTOL)


def test_gather_blocks_follows_the_block_table():
    bs = 4
    cache = torch.arange(6 * bs).float()[:, None, None]  # slot s holds the value s
    got = gather_blocks(cache, [5, 0, 3], 10, bs).flatten().tolist()
    assert got == [20, 21, 22, 23, 0, 1, 2, 3, 12, 13]


# --- block manager -------------------------------------------------------------------------------------------


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, None, ids, SamplingParams(max_tokens=4), 0.0)


def run_prompt(bm: BlockManager, r: Request) -> None:
    """What the scheduler and engine do for a whole prompt: attach cached blocks, allocate, compute, commit."""
    bm.admit(r)
    assert bm.grow(r, r.num_prompt_tokens)
    r.num_computed_tokens = r.num_prompt_tokens
    bm.commit_full_blocks(r)


def test_blocks_needed_and_allocation():
    bm = BlockManager(10, 4, enable_prefix_caching=False, watermark=0.0)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    r = req("a", list(range(10)))
    run_prompt(bm, r)
    assert len(r.block_table) == 3 and len(set(r.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert all(bm.blocks[b].ref_count == 1 for b in r.block_table)
    assert bm.grow(r, 12) and len(r.block_table) == 3, "12 tokens still fit in 3 blocks of 4"
    assert bm.grow(r, 13) and len(r.block_table) == 4
    assert not bm.grow(r, 13 + 4 * 7), "more blocks than the pool has"
    assert len(r.block_table) == 4, "a failed grow must change nothing"
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 10
    bm.check_all_free()
    with pytest.raises(AssertionError, match="freed twice"):
        r.block_table = [0]
        bm.free(r)


def test_ref_counts_with_a_shared_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True, watermark=0.0)
    system = list(range(100, 112))  # 3 full blocks
    a, b = req("a", system + [1, 2, 3]), req("b", system + [7, 8])
    run_prompt(bm, a)
    run_prompt(bm, b)
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 2, 1]
    assert b.block_table[3] != a.block_table[3], "the partial last block is private"
    assert bm.num_free_blocks == 16 - 5
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1, 1]
    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert len(bm.evictable) == 3, "freed full blocks stay cached (evictable), not wiped"
    bm.check_all_free()
    c = req("c", system + [9])
    run_prompt(bm, c)
    assert c.num_cached_tokens == 12 and len(bm.evictable) == 0, "a hit takes its blocks off the LRU list"
    assert bm.hit_rate() == pytest.approx((12 + 12) / (15 + 14 + 13))


def test_cached_tokens_count_the_first_admission_as_vllm_does():
    """A request readmitted after a preemption keeps the cached-token count of its first admission (vLLM reports
    the prefill stats of the first scheduling only): usage.prompt_tokens_details.cached_tokens does not change
    because the request was preempted and its prefix evicted meanwhile."""
    bm = BlockManager(8, 4, enable_prefix_caching=True, watermark=0.0)
    system = list(range(100, 112))  # 3 full blocks
    a = req("a", system + [1])
    run_prompt(bm, a)
    b = req("b", system + [7, 8])
    run_prompt(bm, b)
    assert b.num_cached_tokens == 12
    b.metrics.first_scheduled_time = 0.0  # b ran a step, then was preempted (recompute)
    bm.free(b)
    bm.free(a)
    b.num_computed_tokens = 0
    other = req("other", list(range(500, 532)))  # 8 blocks: evicts every cached block
    run_prompt(bm, other)
    bm.free(other)
    assert bm.admit(b) == 0, "the readmission finds nothing cached"
    assert b.num_cached_tokens == 12, "readmission after preemption must not change the reported cached tokens"
    bm.free(b)
    bm.check_all_free()


def test_match_prefix_leaves_one_token_to_compute():
    bm = BlockManager(8, 4, enable_prefix_caching=True, watermark=0.0)
    run_prompt(bm, req("a", list(range(8))))
    again = req("b", list(range(8)))
    assert len(bm.match_prefix(again)) == 1, "an exact repeat must still compute its last token for the logits"


def test_prefix_hash_is_chained():
    bs = 4
    h1 = block_hash(None, (1, 2, 3, 4))
    assert block_hash(h1, (5, 6, 7, 8)) != block_hash(block_hash(None, (0, 2, 3, 4)), (5, 6, 7, 8))
    bm = BlockManager(16, bs, enable_prefix_caching=True, watermark=0.0)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(bm, a)
    assert [h for h, _ in a.block_hashes] == [h1, block_hash(h1, (5, 6, 7, 8))]
    assert [bm.blocks[b].hash for b in a.block_table[:2]] == [h for h, _ in a.block_hashes]
    # same second block, different first block: no hit at all (K/V of block 2 depend on block 1)
    b = req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(b) == []
    # same first block, different second: hit on the first only
    c = req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert bm.match_prefix(c) == a.block_table[:1]


def test_collision_guard(monkeypatch):
    """Every block hashes alike: a lookup must compare token ids and miss, never hand out someone else's KV."""
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, ids: 42)
    bm = BlockManager(16, 4, enable_prefix_caching=True, watermark=0.0)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(bm, a)
    assert bm.match_prefix(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 1])) == [], "colliding first block must miss"
    # first block truly equal, second collides with it (same hash 42, other ids): hit only the first
    assert bm.match_prefix(req("c", [1, 2, 3, 4, 5, 6, 7, 0, 1])) == a.block_table[:1]
    d = req("d", [9, 9, 9, 9, 5, 6, 7, 8, 1])
    run_prompt(bm, d)
    assert d.num_cached_tokens == 0 and not set(d.block_table) & set(a.block_table)
    bm.free(a)
    bm.free(d)
    bm.check_all_free()


def test_lru_eviction_order():
    bs = 2
    bm = BlockManager(6, bs, enable_prefix_caching=True, watermark=0.0)
    reqs = [req(n, [10 * i + 1, 10 * i + 2, 10 * i + 3]) for i, n in enumerate("abc")]  # one full block each
    for r in reqs:
        run_prompt(bm, r)
    full = {r.request_id: r.block_table[0] for r in reqs}
    for r in reqs:  # free a, then b, then c: a's cached block is the least recently used
        bm.free(r)
    assert list(bm.evictable) == [full["a"], full["b"], full["c"]]
    # touch a's prefix again: it becomes the most recently used
    a2 = req("a2", [1, 2, 9])
    run_prompt(bm, a2)
    assert a2.block_table[0] == full["a"]
    bm.free(a2)
    assert list(bm.evictable) == [full["b"], full["c"], full["a"]]
    # 3 plain free blocks remain; then evictions must go b, c, a
    hog = req("hog", list(range(1000, 1000 + 2 * 6)))
    bm.admit(hog)
    order = []
    for n in range(1, 7):
        assert bm.grow(hog, n * bs)
        if n > 3:
            order.append(hog.block_table[-1])
    assert order == [full["b"], full["c"], full["a"]]
    assert bm.num_cached_blocks == 0 and not bm.match_prefix(req("b2", [11, 12, 13]))
    bm.free(hog)
    bm.check_all_free()


def test_watermark_keeps_blocks_for_running_requests():
    bm = BlockManager(100, 4, enable_prefix_caching=False, watermark=0.1)  # keep 10 blocks free on admission
    assert bm.watermark_blocks == 10
    big = req("big", list(range(4 * 85)))
    assert bm.can_admit(big, big.num_prompt_tokens), "85 + 10 <= 100"
    run_prompt(bm, big)
    assert bm.num_free_blocks == 15
    assert bm.can_admit(req("x", list(range(20))), 20), "5 blocks leave exactly the watermark"
    assert not bm.can_admit(req("y", list(range(21))), 21), "6 blocks would dip below the watermark"
    # a running request may still grow into the watermark
    assert bm.grow(big, 4 * 100)
    assert bm.num_free_blocks == 0
    bm.free(big)
    bm.check_all_free()


def test_check_all_free_catches_a_leak():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    r = req("a", list(range(6)))
    run_prompt(bm, r)
    with pytest.raises(AssertionError, match="still referenced"):
        bm.check_all_free()


# --- CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paged_attention_and_engine_match_cpu():
    """On a GPU: the batched paged path equals dense attention there, and the engine's greedy outputs on CUDA
    equal the CPU engine's (tiny-random in float64: no argmax can flip)."""
    from lab_utils import EngineConfig, LLMEngine, load_model

    context_lens, query_lens, hq, hkv, d, bs = [100, 2, 31, 77, 16], [16, 2, 1, 30, 16], 9, 3, 64, 16
    tables, ks, vs, qs, num_blocks = make_case(3, context_lens, query_lens, hq, hkv, d, bs)
    dev = torch.device("cuda")
    cache = KVCache(1, num_blocks, bs, hkv, d, torch.float32, torch.float32, dev)
    for table, k, v, ql in zip(tables, ks, vs, query_lens):
        s = torch.tensor(slots_of(table, 0, k.shape[0] - ql, bs), dtype=torch.long, device=dev)
        cache.write(0, s, k[:k.shape[0] - ql].to(dev), v[:k.shape[0] - ql].to(dev))
    meta = AttentionMetadata.build(tables, context_lens, query_lens, bs, dev)
    new_k = torch.cat([k[k.shape[0] - ql:] for k, ql in zip(ks, query_lens)]).to(dev)
    new_v = torch.cat([v[v.shape[0] - ql:] for v, ql in zip(vs, query_lens)]).to(dev)
    got = PagedAttention(cache, meta)(0, torch.cat(qs).to(dev)[None], new_k[None], new_v[None])[0].cpu()
    want = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, ks, vs)]).float()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)

    prompts = [[100 + (7 * i + j) % 5000 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        # one model, moved: both engines must run the same weights (tiny-random echoes its last token for a few
        # steps whatever its weights, so a comparison of two different draws parts late, e.g. at the fifth token)
        model, tok = load_model("tiny-random", device="cpu", dtype=torch.float64)
        eng = LLMEngine((model.to(device), tok), EngineConfig(num_gpu_blocks=64, block_size=16,
                                                              max_num_batched_tokens=32, max_model_len=256),
                        device=device)
        outs[device] = [o.token_ids for o in eng.generate(prompts, params)]
        eng.block_manager.check_all_free()
        assert eng.runner.fast_path_errors == {}  # no fast path fell back (none is chosen for a dtype it lacks)
    assert outs["cuda"] == outs["cpu"]
