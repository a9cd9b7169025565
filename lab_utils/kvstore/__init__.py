"""KV beyond the device (lab 14). Returning conversations as a trace (`returning.py`) and the arithmetic of
copying a block back against recomputing it (`costs.py`), for the engine's host tier
(`lab_utils.engine.kv.host_tier`); a store shared between processes, Mooncake-style
(`store.py`: the store process; `tier.py`: the store under an engine's prefix cache; `workers.py`: prefill
workers that share it); where each returning turn's prompt came from, device, host, store or recomputed
(`sources.py`). The decode side, a disaggregated cluster's hand-off through the store, is
`lab_utils.disagg.store_handoff` (`DisaggregatedCluster(kv_transfer="store")`)."""
