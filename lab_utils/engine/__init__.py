"""The serving engine, read top to bottom: LLMEngine.step() -> Scheduler.schedule() (uses BlockManager)
-> ModelRunner.run() -> Sampler -> outputs with per-token timestamps.

The teaching core, one idea a file:
- `request.py` (a request's state), `sampling_params.py`, `config.py` (EngineConfig, vLLM's names);
- `scheduler.py` (static, continuous and token-budget steps, preemption), `block_manager.py` (paged KV
  bookkeeping, prefix cache), `kv_cache.py` (where K/V live), `kv_budget.py` (how big the pool is);
- `attention.py` (paged attention and the slot mapping), `model_runner.py` (a step as one forward pass),
  `sampler.py` (sampling and the logit processors), `logprobs.py` (token and prompt logprobs), `engine.py`
  (LLMEngine);
- `parts.py`: the seam through which the labs' exercises replace named parts of the above;
- `structured*.py`: grammar-constrained decoding (lab 13); `memory.py`: KV accounting for the labs' figures.
Everything that only makes the same steps faster (CPU kernels, packed and fused linears, FlexAttention, CUDA
graphs) lives in `accel/`, behind one import.
"""
