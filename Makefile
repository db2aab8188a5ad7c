# megatron-lev: the two commands are `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megatron-lev-installed
# CPU machines get the 2.13.0 CPU wheel; a machine with an NVIDIA driver keeps/installs a CUDA torch.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# The fake-CUDA device checks (tests marked cuda_build) need the CUDA build of torch, which PyPI serves
# for Python 3.12; it runs on the CPU here (no GPU needed).
# The first candidate that runs and is 3.12 (a pyenv shim on PATH may not run).
PYTHON312   ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do \
                 "$$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$$c"; break; }; done)
VENV_CUDA   ?= .venv-cuda
PY_CUDA     := $(VENV_CUDA)/bin/python
STAMP_CUDA  := $(VENV_CUDA)/.megatron-lev-installed

# The newer stack users run (NGC-style): Python 3.12, the CUDA build of torch, the newest megatron-core 0.19.x.
# make test-next runs the whole suite there (the cuda_build tests included: that torch is a CUDA build).
VENV_NEXT   ?= .venv-next
PY_NEXT     := $(VENV_NEXT)/bin/python
STAMP_NEXT  := $(VENV_NEXT)/.megatron-lev-installed
MCORE_NEXT  ?= megatron-core>=0.19,<0.20

# Extra pytest flags (.ci/run passes --durations to print the slowest tests).
PYTEST_FLAGS ?=
# The suite runs on pytest-xdist workers, one a core up to 4, a test file to a worker (a module's fixtures
# and multi-run jobs stay whole; session artefacts are built once for all workers, tests/conftest.py's
# built_once). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
XDIST := -n $(TEST_WORKERS) --dist loadfile
# make test-next and make test-shuffled run the suite in a shuffled order (modules, and the tests inside each), fixed by
# this seed, so that a test depending on what an earlier one left behind fails here, not on a user's machine.
SHUFFLE_SEED ?= 33

.PHONY: setup demo test test-gpu-programs test-next test-shuffled test-fast test-fake-cuda bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first: installed by anything else, pip would pull a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: setup
	bash examples/quickstart_cpu.sh

# The GPU check's programs end to end at --sizes tiny (several minutes of training runs each on 2 cores) have a
# target of their own, run before a device window: make test stays within its budget.
NOT_PROGRAMS := -m "not gpu_program"

test: setup
	$(PY) -m pytest -q $(XDIST) $(NOT_PROGRAMS) $(PYTEST_FLAGS)

test-gpu-programs: setup
	$(PY) -m pytest -q $(XDIST) -m gpu_program $(PYTEST_FLAGS)

test-fake-cuda: $(STAMP_CUDA)
	$(PY_CUDA) -m pytest -q -p no:cacheprovider -m cuda_build

$(STAMP_CUDA): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: make test-fake-cuda needs Python 3.12 (python3.12 on PATH or under ~/.pyenv/versions); set PYTHON312=/path/to/python3.12"; exit 2; }
	@test -x $(PY_CUDA) || $(PYTHON312) -m venv $(VENV_CUDA)
	@$(PY_CUDA) -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null || $(PY_CUDA) -m pip install -q "torch==2.13.0"
	@$(PY_CUDA) -c "import torch, sys; sys.exit(torch.version.cuda is None)" || { echo "error: $(VENV_CUDA) got a CPU-only torch; install a CUDA build of torch 2.13.0 there"; exit 2; }
	$(PY_CUDA) -m pip install -q -e . pytest
	@touch $(STAMP_CUDA)

# The newer stack's run is also the order check: modules, and the tests inside each, in a shuffled order
# fixed by SHUFFLE_SEED, so that a test depending on what an earlier one left in its worker fails in CI.
# The examples/pile launch scripts (marker scripts: several torchrun agents and a simulated Slurm allocation,
# their subject the scripts' own logic) run once, in make test: CI's two stacks stay within its budget.
NOT_NEXT := -m "not gpu_program and not scripts"

test-next: $(STAMP_NEXT)
	$(PY_NEXT) -m pytest -q -p no:cacheprovider $(XDIST) $(NOT_NEXT) --random-order-bucket=module \
	  --random-order-seed=$(SHUFFLE_SEED) $(PYTEST_FLAGS)

# The suite on the newer stack in a shuffled order in one process: every test after every other.
test-shuffled: $(STAMP_NEXT)
	$(PY_NEXT) -m pytest -q -p no:cacheprovider -n 0 --random-order-bucket=module \
	  --random-order-seed=$(SHUFFLE_SEED) $(PYTEST_FLAGS)

$(STAMP_NEXT): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: make test-next needs Python 3.12 (python3.12 on PATH or under ~/.pyenv/versions); set PYTHON312=/path/to/python3.12"; exit 2; }
	@test -x $(PY_NEXT) || $(PYTHON312) -m venv $(VENV_NEXT)
	@$(PY_NEXT) -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null || $(PY_NEXT) -m pip install -q "torch==2.13.0"
	@$(PY_NEXT) -c "import torch, sys; sys.exit(torch.version.cuda is None)" || { echo "error: $(VENV_NEXT) got a CPU-only torch; install a CUDA build of torch 2.13.0 there"; exit 2; }
	$(PY_NEXT) -m pip install -q -U "$(MCORE_NEXT)"
	$(PY_NEXT) -m pip install -q -e ".[dev]"
	@touch $(STAMP_NEXT)

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow"

bench: setup
	$(PY) bench/lev_layer.py

clean-venv:
	rm -rf $(VENV) $(VENV_CUDA) $(VENV_NEXT)
