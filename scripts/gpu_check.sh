#!/usr/bin/env bash
# The GPU check for a lent machine (one H200, no network; DESIGN.md section 10), in <= 8 minutes:
#   env         torch/transformers versions, the GPU
#   unit        the CUDA-path unit tests (graphs, flex, KV sizing)
#   hf_match    lab-engine greedy tokens = Hugging Face transformers on the same random weights (fp32),
#               SmolLM2-135M and Llama-3.2-1B shapes
#   bandwidth   decode step at batch 1 vs the bandwidth bound (goal: >= 60 % for the 1B shape with graphs)
#   throughput  output tokens/s at batch 64-256, with and without CUDA graphs
#   labs        the labs in SMOKE mode: all of them where papermill and SmolLM2's GGUF are present; else lab 00
#               with random weights of SmolLM2's shape, run by scripts/run_notebook.py (no Jupyter needed)
# Each stage runs in its own process under its own timeout and writes ${OUT:-out/gpu}/<stage>.json when it
# ends; a table follows; the exit code is non-zero if any stage failed or timed out.
#
#   bash scripts/gpu_check.sh                                   # on the GPU machine
#   DEVICE=cpu GPU_CHECK_SIZE=tiny bash scripts/gpu_check.sh    # CI: every stage at toy sizes on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-${OUT:-out/gpu}}
DEVICE=${DEVICE:-cuda}
SIZE=${GPU_CHECK_SIZE:-$([ "$DEVICE" = cpu ] && echo tiny || echo full)}
# the project's venv when there is one (a lent machine has only its own python)
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# pure-Python packages the lent machine lacks travel as wheels (plotly and narwhals for the labs stage):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: plotly narwhals -d wheels/
WHEELS=${GPU_CHECK_WHEELS:-wheels}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || echo "warning: could not install $WHEELS/*.whl" >&2
fi
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/{env,unit,hf_match,bandwidth,throughput,labs}.json

if [ "$DEVICE" != cpu ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "FAILED: nvidia-smi sees a GPU but this torch cannot use it ($($PY -c 'import torch; print(torch.__version__)')):" \
         "install a torch built for this driver's CUDA" >&2
  else
    echo "FAILED: needs CUDA (DEVICE=cpu GPU_CHECK_SIZE=tiny runs the CPU rehearsal of this script)" >&2
  fi
  exit 2
fi
if [ "$DEVICE" != cpu ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt" || true
fi

# stage:timeout (s). Sum = 450 s, inside the 8-minute budget with start-up to spare.
STAGES=${GPU_CHECK_STAGES:-"env:20 unit:60 hf_match:80 bandwidth:80 throughput:120 labs:90"}
failed=0
start=$(date +%s)
for item in $STAGES; do
  stage=${item%%:*}
  limit=${item##*:}
  rc=0
  timeout --kill-after=5 "$limit" $PY scripts/gpu_check.py --stage "$stage" --device "$DEVICE" --size "$SIZE" \
    --out "$OUT_DIR" ${GPU_CHECK_ARGS:-} || rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=1
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "[$stage] TIMED OUT after ${limit} s" >&2
      printf '{"stage": "%s", "status": "failed", "seconds": %s, "figures": {}, "rows": [], "error": "timed out after %s s"}\n' \
        "$stage" "$limit" "$limit" > "$OUT_DIR/$stage.json"
    fi
  fi
done
echo
$PY scripts/gpu_check.py --table --out "$OUT_DIR" | tee "$OUT_DIR/table.txt"
echo "total $(( $(date +%s) - start )) s; JSON in $OUT_DIR"
if [ "$failed" -ne 0 ]; then
  echo "GPU CHECK FAILED" >&2
  exit 1
fi
echo "GPU CHECK PASSED"
