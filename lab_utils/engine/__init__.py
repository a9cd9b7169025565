"""The serving engine, read top to bottom: LLMEngine.step() -> Scheduler.schedule() (uses BlockManager)
-> step hooks plan -> ModelRunner.run() -> hooks mask -> sampler (or a verify hook) -> outputs with
per-token timestamps.

The teaching core, one idea a file:
- `request.py` (a request's state), `sampling_params.py`, `config.py` (EngineConfig, vLLM's names);
- `scheduler.py` (the queues, admission and preemption every policy shares) and its policies in
  `scheduling/` (`static.py`, `continuous.py`: lab 01, `chunked_prefill.py`: the token budget, lab 03);
- `kv/`: the KV hierarchy, its map in `kv/__init__.py`: `paging.py` (the block pool and its reference counts,
  the slot of a token, KV bytes per token: lab 02), `prefix_cache.py` (the hash chain: lab 04),
  `block_manager.py` (the two together, and admission), `kv_cache.py` (where K/V live), `kv_budget.py` (how big
  the pool is), `tier.py` (the `Tier` seam under the pool: what the prefix cache asks of any tier, the one walk
  that names a prompt's blocks), `host_tier.py` and `disk_tier.py` (the tiers under the device pool),
  `block_copies.py`, `memory.py` (KV accounting for the labs' figures);
- `attention.py` (paged attention and the slot mapping), `model_runner.py` (a step as one forward pass),
  `sampler.py` (sampling and the logit processors), `logprobs.py` (token and prompt logprobs), `engine.py`
  (LLMEngine);
- `hooks.py` (`StepHook`: how a feature joins every step without the step naming it), `features.py` (the
  hooks an engine's config asks for: speculative decoding, `lab_utils.speculative`; structured output,
  `lab_utils.structured`);
- `replaceable.py`: the seam through which the labs' exercises replace named parts of the above;
Everything that only makes the same steps faster (CPU kernels, packed and fused linears, FlexAttention, CUDA
graphs) lives in `accel/`, behind one import.
"""
