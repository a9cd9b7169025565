"""Median decode-step time of the engine at several batch sizes (whatever lab_utils PYTHONPATH gives).

    python benchmarks/engine_step_times.py LABEL 1 8 32      # QUANTIZATION=int8|w8a8|w8a8-g32|int4 for a quantized engine
"""
import json
import os
import statistics
import sys
import time

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model

model, tok = load_model("smollm2-135m", device="cpu")
res = {}
for B in [int(b) for b in sys.argv[2:]]:
    eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=B, block_size=32, kv_cache_memory_bytes=256 << 20,
                                                    quantization=os.environ.get("QUANTIZATION") or None), device="cpu")
    for i in range(B):
        eng.add_request([100 + i] + list(range(200, 295)), SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.is_prefill for r in eng.requests.values()):
        eng.step()
    eng.step()
    ts = []
    for _ in range(7):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    res[B] = 1e3 * statistics.median(ts)
print(json.dumps({"label": sys.argv[1], "quantization": os.environ.get("QUANTIZATION") or None,
                  "decode_step_ms": res}), flush=True)
