#!/usr/bin/env bash
# The GPU check for a lent machine (one H200): every lab with DEVICE=cuda, then decode vs the bandwidth bound.
# Prints a short table; results go to ${OUT:-out/gpu}. Without CUDA it says so and exits 0 (never a false pass).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
if ! nvidia-smi -L >/dev/null 2>&1 || ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "skipped: needs CUDA"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
$PY -m lab_utils prepare
# 0) the CUDA fast paths: flex attention and decode CUDA graphs vs the eager path (step time, same tokens),
#    then their unit tests (CPU-skipped parts included)
timeout 120 $PY benchmarks/fast_paths.py --device cuda --batches 1 8 32 64 --steps 10 \
  --json "$OUT_DIR/fast_paths.json"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/unit/test_fast_paths.py 2>&1 | tail -3
# 1) decode step vs the memory-bandwidth bound, and throughput at large batch
timeout 150 $PY benchmarks/decode_bound.py --device cuda --models smollm2-135m llama-3.2-1b-random \
  --batches 1 64 128 256 --json "$OUT_DIR/decode_bound.json"
# 2) the labs on the GPU (SMOKE sizes keep this inside the lease; the whole script stays under 8 min)
timeout 150 $PY -m lab_utils run-labs --smoke --device cuda --out "$OUT_DIR/labs"
echo "results in $OUT_DIR"
