# megatron-lev: the two commands are `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megatron-lev-installed
# CPU machines get the 2.13.0 CPU wheel; a machine with an NVIDIA driver keeps/installs a CUDA torch.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: setup demo test test-fast bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: installed by anything else, pip would pull a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: setup
	bash examples/quickstart_cpu.sh

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) bench/lev_layer.py

clean-venv:
	rm -rf $(VENV)
