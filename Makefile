# megaframe: `make train` (set up, prepare the demo corpus, pretrain) and `make test` (set up, run every test).
# Everything lands in .venv; torch is pinned by constraints.txt (a CPU wheel here, CUDA on GPU hosts).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
ARGS   ?=
RUN    ?= demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: install data train test lint test-fast slurm-up slurm-down slurm-test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@# Debian's python3 needs python3-venv for ensurepip; install it when missing and we may
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[test,eval]"
	touch $@

data: $(VENV)/.installed data/demo/prepared/meta.json

data/demo/prepared/meta.json:
	$(PY) -m megaframe.data.prepare

train: data
	MEGAFRAME_RUN_NAME=$(RUN) $(PY) train.py $(ARGS)

# three pytest-xdist lanes on 2 cores: the process-starting tests in order, the rest beside them, and the
# Slurm tests (mostly waiting) beside both (tests/workers.py)
test: $(VENV)/.installed lint
	@# byte-compiled once: where PYTHONDONTWRITEBYTECODE is set, each of the suite's hundreds of processes
	@# compiled the package from source again (~0.1-0.2 s of CPU each)
	$(PY) -m compileall -q megaframe tests scripts train.py >/dev/null
	$(PY) -m pytest -q -rs -n 3 $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# ruff (pyflakes, pycodestyle, import order, bugbear; pyproject.toml [tool.ruff]) and ruff's formatter at 110
# columns (check only): seconds, before the tests
lint: $(VENV)/.installed
	$(PY) -m ruff check megaframe tests scripts benchmarks train.py
	$(PY) -m ruff format --check --quiet megaframe tests scripts benchmarks train.py

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not e2e" $(ARGS)

# A real single-host Slurm (two emulated nodes) for scripts/slurm/pretrain.sbatch; needs root.
# `make test` starts it itself for the slurm tests (when root) and stops it afterwards.
slurm-up:
	bash scripts/slurm/local_cluster.sh start

slurm-down:
	bash scripts/slurm/local_cluster.sh stop

slurm-test: $(VENV)/.installed
	$(PY) -m pytest -q -rs -m slurm $(ARGS)

clean:
	rm -rf $(VENV) data/demo/prepared outputs
