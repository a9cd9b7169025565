"""The shared KV store (lab_utils.kvstore): the store's bookkeeping, the store process with clients, names that
every process computes alike, and engines that skip a prefill because another engine published its blocks."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils import EngineConfig, SamplingParams
from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.kv.paging import bytes_per_token
from lab_utils.kvstore.store import KVStoreProcess
from lab_utils.kvstore.tier import attach, detach, stable_names
from lab_utils.kvstore.store import BlockStore
from lab_utils.kvstore.tier import decode, encode


def _payload(n: int) -> dict:
    return {"k": ("uint8", (n,), bytes(n))}


def test_block_store_keeps_matches_and_drops_least_recently_used():
    s = BlockStore(capacity_bytes=300)
    assert s.put(b"a", (1, 2), _payload(100)) and s.put(b"b", (3, 4), _payload(100))
    assert not s.put(b"a", (1, 2), _payload(100))  # held already: only counted as used (now newest)
    assert s.get(b"a", (9, 9)) is None  # a name with other tokens is a miss, never a wrong hit
    assert s.put(b"c", (5, 6), _payload(100)) and s.put(b"d", (7, 8), _payload(100))  # "b" goes: oldest
    assert s.has(b"a", (1, 2)) and not s.has(b"b", (3, 4)) and s.has(b"d", (7, 8))
    assert s.stats.bytes_used == 300 and s.stats.dropped == 1 and s.stats.blocks == 3
    assert not s.put(b"e", (0,), _payload(301)) and s.stats.refused == 1  # larger than the whole store
    assert s.get(b"c", (5, 6))["k"][2] == bytes(100) and s.stats.hits == 1 and s.stats.get_bytes == 100
    with pytest.raises(ValueError, match="capacity_bytes"):
        BlockStore(0)


def test_payload_round_trip_keeps_dtype_shape_and_bytes():
    saved = {"k": torch.randn(3, 4, 2), "v": torch.arange(24, dtype=torch.int8).reshape(3, 8),
             "k_scale": torch.rand(3, 4, dtype=torch.float16)}
    back = decode(encode(saved))
    for name, t in saved.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_store_process_serves_two_clients_and_leaves_nothing_behind():
    with KVStoreProcess(capacity_bytes=1 << 20) as store:
        a, b = store.client(), store.client()
        assert a.put(b"x", (1, 2, 3), _payload(1000))
        assert b.has(b"x", (1, 2, 3)) and b.get(b"x", (1, 2, 3))["k"][2] == bytes(1000)
        assert b.get(b"x", (1, 2, 4)) is None
        st = a.store_stats()
        assert (st.puts, st.gets, st.hits, st.bytes_used) == (1, 2, 1, 1000)
        assert a.stats.put_bytes == 1000 and b.stats.get_bytes == 1000 and b.stats.seconds > 0
        with pytest.raises(RuntimeError, match="refused put"):
            a._call("put", b"y")  # a malformed request fails that request; the store serves on
        assert b.has(b"x", (1, 2, 3))
        address = store.address
    assert not store.process.is_alive()
    assert not os.path.exists(address)  # the socket file went with the store


def _names_in_a_fresh_process(out) -> None:
    from lab_utils.kvstore.tier import stable_names as names

    out.send(names(list(range(40)), 16))


def test_stable_names_are_a_chain_equal_in_every_process():
    ids = list(range(40))
    mine = stable_names(ids, 16)
    assert len(mine) == 2  # full blocks only
    assert stable_names([99] + ids[1:], 16)[1] != mine[1]  # block 1's name depends on block 0's tokens
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_names_in_a_fresh_process, args=(child,))
    p.start()
    theirs = parent.recv()
    p.join(60)
    assert theirs == mine  # unlike the engine's hash(None)-rooted names, which differ between processes


PROMPT = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks so that memory is "
          "allocated on demand, and blocks holding a shared prefix can be reused by every request that starts "
          "with it.")


def _engine(**kw) -> LLMEngine:
    cfg = dict(num_gpu_blocks=64, block_size=16, enable_prefix_caching=True, max_num_seqs=4)
    cfg.update(kw)
    return LLMEngine("smollm2-135m", EngineConfig(**cfg), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def engines():
    engs = _engine(), _engine(), _engine()
    yield engs
    for e in engs:
        detach(e)


def test_an_engine_skips_the_prefill_another_engine_published(engines):
    writer, reader, plain = engines
    params = SamplingParams(max_tokens=8, temperature=0.0)
    own_hooks = len(writer.hooks)
    with KVStoreProcess(capacity_bytes=64 << 20) as store:
        tier_w = attach(writer, store.client(), publish=True)
        tier_r = attach(reader, store.client())
        first = writer.generate([PROMPT], params)[0]
        n_full = len(first.prompt_token_ids) // 16
        assert tier_w.blocks_out == n_full and store.client().store_stats().blocks == n_full
        follow = PROMPT + " The scheduler decides which requests run in each step."
        got = reader.generate([follow], params)[0]
        want = plain.generate([follow], params)[0]
        assert got.num_cached_tokens == n_full * 16  # the reader computed none of the shared blocks
        assert want.num_cached_tokens == 0
        assert got.token_ids == want.token_ids  # the same greedy tokens as computing them
        cfg = writer.model.config
        per_token = bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.hidden_size // cfg.num_attention_heads, torch.float32)
        assert tier_w.bytes_out == n_full * 16 * per_token  # the blocks' K/V, every layer, nothing else
        assert tier_r.blocks_in == n_full and tier_r.bytes_in == tier_w.bytes_out
        assert reader.stats()["store_tier_hits"] == n_full
        bm = reader.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # nothing leaked (cached blocks count as free)
        writer.generate([PROMPT], params)
        assert tier_w.blocks_out == n_full  # published once: the store holds them already
    detach(writer), detach(reader)
    assert writer.block_manager.host_tier is None and len(writer.hooks) == own_hooks


def test_attach_refuses_an_engine_without_the_prefix_cache():
    from lab_utils.kvstore.store import KVStoreClient

    eng = _engine(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        attach(eng, KVStoreClient("/nonexistent", b"k"))


def _prefill_worker(client, prompt_ids: list[int], out) -> None:
    """Another process's engine (a prefill worker): computes the prompt and publishes its blocks."""
    eng = _engine()
    tier = attach(eng, client, publish=True)
    eng.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0))
    out.send((tier.blocks_out, tier.bytes_out))


def test_a_block_published_by_another_process_is_found(engines):
    """Names that mean the same in both processes: the engine's own names (hash chained from None) differ
    between processes, the store's do not; the reader computes none of the blocks the other process wrote."""
    _, reader, plain = engines
    tok = reader.tokenizer
    prompt = tok.encode("A returning conversation finds its earlier turns in the store, not on this device. " * 3)
    with KVStoreProcess(capacity_bytes=64 << 20) as store:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_prefill_worker, args=(store.client(), prompt, child))
        p.start()
        blocks_out, bytes_out = parent.recv()
        p.join(120)
        n_full = len(prompt) // 16
        assert blocks_out == n_full
        tier = attach(reader, store.client())
        params = SamplingParams(max_tokens=6, temperature=0.0)
        got = reader.generate([prompt + tok.encode(" What is left?")], params)[0]
        want = plain.generate([prompt + tok.encode(" What is left?")], params)[0]
        assert got.num_cached_tokens == n_full * 16 and got.token_ids == want.token_ids
        assert tier.client.stats.get_bytes == bytes_out
