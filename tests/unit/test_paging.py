"""The paging helpers every module uses: the slot of a token, the KV bytes of a token, and the prefix caches."""
from __future__ import annotations

import pytest
import torch

from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.paging import KV_CACHE_DTYPES, bytes_per_token, slot
from lab_utils.engine.request import Request
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.quant.kv import kv_bytes_per_token


def test_slot_on_ints_tensors_and_batched_tables():
    table, bs = [7, 2, 5], 4
    want = [table[p // bs] * bs + p % bs for p in range(10)]
    assert [slot(table, p, bs) for p in range(10)] == want
    assert slot(torch.tensor(table), torch.arange(10), bs).tolist() == want
    tables = torch.tensor([table, [1, 0, 3]])
    assert slot(tables, torch.arange(10), bs).tolist() == [want, [[1, 0, 3][p // bs] * bs + p % bs for p in range(10)]]


@pytest.mark.parametrize("name", list(KV_CACHE_DTYPES))
def test_bytes_per_token_is_what_the_cache_allocates(name):
    layers, heads, dim, blocks, bs = 3, 2, 8, 5, 4
    cache = KVCache(layers, blocks, bs, heads, dim, torch.float32, KV_CACHE_DTYPES[name], torch.device("cpu"))
    assert cache.nbytes == blocks * bs * bytes_per_token(layers, heads, dim, KV_CACHE_DTYPES[name])


def test_smollm2_kv_bytes_one_count_for_engine_and_quant_lab():
    from lab_utils.models.llama import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    for name, store in KV_CACHE_DTYPES.items():
        assert kv_bytes_per_token(cfg, name) == bytes_per_token(30, 3, 64, store)
    assert kv_bytes_per_token(cfg, "int8") == 12240 and kv_bytes_per_token(cfg, "fp8_e4m3") == 11520


def test_a_pool_without_prefix_cache_frees_released_blocks_at_once():
    pool = BlockManager(4, 2, enable_prefix_caching=False, watermark=0.0)
    req = Request("a", None, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 0.0)
    assert pool.match_prefix(req) == [] and pool.grow(req, 5) and req.block_table == [0, 1, 2]
    pool.commit_full_blocks(req)
    pool.free(req)
    assert not pool.evictable and sorted(pool.free_ids) == [0, 1, 2, 3]
    assert pool.num_cached_blocks == 0 and pool.hit_rate() == 0.0
    pool.check_all_free()
