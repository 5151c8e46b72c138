# Two commands on a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8888
HOST   ?= 127.0.0.1
# The CPU build of torch; installed first only where the venv has no torch >= 2.13, so a
# user's newer torch (or a CUDA build they chose) is left alone.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup demo test lint bench notebooks clean

setup: $(VENV)/.installed

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { echo >&2 "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu: apt-get install python3-venv"; exit 1; }

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 13))" 2>/dev/null \
		&& echo "torch already installed: keeping it" \
		|| $(BIN)/python -m pip install --progress-bar off "$(TORCH)"
	$(BIN)/python -m pip install --progress-bar off -e ".[test]"
	@touch $@

demo: setup
	@echo "Starting JupyterLab on notebooks/ at http://$(HOST):$(PORT)/ (the URL with its login token follows)"
	cd notebooks && ../$(BIN)/jupyter lab --no-browser --ip=$(HOST) --port=$(PORT) $(ALLOW_ROOT) \
		--ServerApp.port_retries=0 --LabApp.default_url=/lab/tree/01_tour.ipynb

test: setup
	$(BIN)/python -m ruff check shardviz tests benchmarks docs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/python -m ruff check shardviz tests benchmarks docs
	$(BIN)/python -m ruff format --check shardviz tests benchmarks docs

notebooks: setup
	$(BIN)/python notebooks/execute.py

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .hypothesis
