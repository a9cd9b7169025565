"""The KV hierarchy: where a token's K and V live, from the device pool down to disk, and who decides.

Top to bottom, as a prompt's block travels:

    BlockManager (block_manager.py)       what the scheduler asks: can a request start, grow it, free it
      = HashChainPrefixCache              names full blocks by a hash chain, reuses them (prefix_cache.py, lab 04)
      + BlockPool                         the device blocks and their reference counts (paging.py, lab 02)
      host_tier: a Tier or None           a named block the device evicts goes there and comes back from there
        HostTier (host_tier.py)           host memory, bounded in bytes, an eviction policy
          DiskTier (disk_tier.py)         one preallocated file under the host tier: what it drops
        (or lab_utils.kvstore.StoreTier)  a store shared between engines, in its place
    KVCache (kv_cache.py)                 the device tensors a block id addresses (slot = block * size + offset)
    BlockCopies (block_copies.py)         one block's K/V between the device cache and host memory

The seam between the pool and the tier under it is `tier.py`: the `Tier` protocol (holds, take, restore,
offload, prefetch, release, stats, books, close, and `excluded_parts`, the learner parts it cannot run under),
`prompt_block_names` (the one walk that names a prompt's full blocks), `attach_tier` (the one place that refuses
a tier under those parts), `prefetch_prompt`, and the stats vocabulary every tier reports in
(`<kind>_tier_hits`, `_blocks_in`, `_bytes_in`, `_seconds_in`, `_blocks_out`, ... for host, disk and store).
`host_tier.host_tier_for(config, kv_cache)` builds the tier an `EngineConfig` asks for.

Sizing and accounting: `kv_budget.py` (how much device memory the pool gets, vLLM's rule), `memory.py`
(capacity arithmetic and per-step snapshots for the labs' figures); `paging.bytes_per_token` is the one count of
a token's KV bytes.

Arrows go down only: nothing here imports the scheduler, the engine, the course or the checks.
"""
