# Two commands on a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8888
HOST   ?= 127.0.0.1
# The CPU build of torch; installed first only where the venv has no torch >= 2.11 (the oldest
# shardviz supports), so a user's torch (or a CUDA build they chose) is left alone.
TORCH  ?= torch==2.13.0
# The newest torch on the package index, for `make test-compat` in a venv of its own. PyPI's Linux
# wheels of it are CUDA builds (~3 GB with their libraries); they run on a machine without a GPU.
TORCH_NEWEST ?= torch==2.15.0
COMPAT_VENV  ?= .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(subst =,-,$(TORCH_NEWEST))
# An older supported torch, in a venv of its own named after it (.venv-2.11, .venv-2.12):
# `make test-old` runs the unit tests and the notebooks that apply on it; CI runs the oldest.
# PyPI's Linux wheels of these are CUDA builds too.
TORCH_OLD ?= 2.11.0
OLD_VENV  ?= .venv-$(word 1,$(subst ., ,$(TORCH_OLD))).$(word 2,$(subst ., ,$(TORCH_OLD)))
OLD_STAMP := $(OLD_VENV)/.installed-torch-$(TORCH_OLD)
# torchtitan for tests/titan (its own code on simulated ranks): installed without its declared
# dependencies, which would pull in another torch; the `titan` extra has what its imports need.
TORCHTITAN ?= torchtitan==0.3.0
# NVIDIA PhysicsNeMo for tests/physicsnemo and notebook 10: its wheel and the s3fs chain its imports
# load, without declared dependencies (PhysicsNeMo's pull a CUDA torchvision that cannot be
# imported with the CPU torch; aiobotocore's botocore would take python-dateutil back a major
# version). The `physicsnemo` extra has the rest of what its imports need.
PHYSICSNEMO ?= nvidia-physicsnemo==2.2.2 s3fs==2026.9.0 aiobotocore==3.10.0 botocore==1.43.117 \
	jmespath==1.1.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 \
	multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 wrapt==2.5.2 aioitertools==0.13.0
PYTEST_ARGS ?=
# The documentation site: built into $(DOCS_OUT)/html; `make docs-serve` serves it on
# 127.0.0.1:$(DOCS_PORT) and rebuilds it when a page changes.
DOCS_OUT  ?= build/docs
DOCS_PORT ?= 8000
NODE_STAMP := node_modules/.installed
DEMO_STAMP := $(VENV)/.installed-demo
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup demo frameworks test test-unit test-compat test-old compat-venv old-venv gpu-wheels lint bench notebooks docs docs-serve clean

setup: $(VENV)/.installed

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { echo >&2 "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu: apt-get install python3-venv"; exit 1; }

define install_torch
	@$(BIN)/python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" 2>/dev/null \
		&& echo "torch already installed: keeping it" \
		|| $(BIN)/python -m pip install --progress-bar off "$(TORCH)"
endef

# Everything `make test` needs; it holds what the demo needs too. The `test` extra brings
# transformers and accelerate (the `hf` extra, pinned) with their dependencies: none of them
# replaces torch, so they need no --no-deps.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(install_torch)
	$(BIN)/python -m pip install --progress-bar off -e ".[test]"
	$(call install_frameworks,$(BIN))
	@touch $@ $(DEMO_STAMP)

# torchtitan and PhysicsNeMo (notebooks 09 and 10) without their declared dependencies, which would
# replace torch (their imports' needs are the `titan` and `physicsnemo` extras); $(1) is a venv's bin.
define install_frameworks
	$(1)/python -m pip install --progress-bar off --no-deps "$(TORCHTITAN)"
	$(1)/python -m pip install --progress-bar off --no-deps $(PHYSICSNEMO)
endef

# What `make demo` needs to run every notebook, none of the test toolchain: shardviz with the
# `notebook` extra, then torchtitan and PhysicsNeMo. Binder's postBuild installs the same.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(install_torch)
	$(BIN)/python -m pip install --progress-bar off -e ".[notebook]"
	$(call install_frameworks,$(BIN))
	@touch $@

# The --no-deps packages above, for binder/postBuild.
frameworks:
	@echo "$(TORCHTITAN)" $(PHYSICSNEMO)

demo: $(DEMO_STAMP)
	@echo "Starting JupyterLab on notebooks/ at http://$(HOST):$(PORT)/ (the URL with its login token follows)"
	cd notebooks && ../$(BIN)/jupyter lab --no-browser --ip=$(HOST) --port=$(PORT) $(ALLOW_ROOT) \
		--ServerApp.port_retries=0 --LabApp.default_url=/lab/tree/01_tour.ipynb

# Everything: the linters and type checker (`make lint`), then the whole suite. The notebooks run
# once, in tests/test_demo.py: in a kernel of an environment built as `make demo` builds it. The
# path `tests` is given, not `--ignore=notebooks`: pytest applies --ignore only below the paths it
# starts from, and pyproject's testpaths start from notebooks/ too, so it ran them a second time.
test: lint
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# The unit tests alone (~8 minutes on 2 cores): no browser, no cluster, no notebooks, nothing marked slow
# (building the wheel); `make test` runs those too.
test-unit: setup
	$(BIN)/python -m pytest tests/unit -q -m "not slow" $(PYTEST_ARGS)

# The unit tests, torchtitan's, PhysicsNeMo's and the notebooks again, on the newest torch
# (TORCH_NEWEST) in $(COMPAT_VENV).
test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c "import torch; print('test-compat: torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest tests/unit tests/titan tests/physicsnemo notebooks $(PYTEST_ARGS)

# The venvs alone (CI installs each before it is needed: .ci/run).
compat-venv: $(COMPAT_STAMP)
old-venv: $(OLD_STAMP)

$(COMPAT_STAMP): pyproject.toml
	@$(PYTHON) -m venv $(COMPAT_VENV) || { echo >&2 "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu: apt-get install python3-venv"; exit 1; }
	@echo "installing $(TORCH_NEWEST) into $(COMPAT_VENV) (a CUDA build from PyPI: ~3 GB to download)"
	$(COMPAT_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_NEWEST)"
	$(COMPAT_VENV)/bin/python -m pip install --progress-bar off -e ".[test]"
	$(call install_frameworks,$(COMPAT_VENV)/bin)
	@rm -f $(COMPAT_VENV)/.installed-*
	@touch $@

# The unit tests (not those marked slow) and notebooks 01-05 on an older torch (TORCH_OLD) in
# $(OLD_VENV): what CI runs on the oldest. On 2.11 notebooks 06-08, 10 and 11 pass too (~6 more
# minutes: `make test-old OLD_TESTS="tests/unit notebooks"`); 09's torchtitan 0.3.0 does not import on 2.11.
OLD_TESTS ?= -m "not slow" tests/unit $(sort $(wildcard notebooks/0[1-5]_*.ipynb))
test-old: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -c "import torch; print('test-old: torch', torch.__version__)"
	$(OLD_VENV)/bin/python -m pytest $(OLD_TESTS) $(PYTEST_ARGS)

$(OLD_STAMP): pyproject.toml
	@$(PYTHON) -m venv $(OLD_VENV) || { echo >&2 "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu: apt-get install python3-venv"; exit 1; }
	@echo "installing torch==$(TORCH_OLD) into $(OLD_VENV) (a CUDA build from PyPI: ~3 GB to download)"
	$(OLD_VENV)/bin/python -m pip install --progress-bar off "torch==$(TORCH_OLD)"
	$(OLD_VENV)/bin/python -m pip install --progress-bar off -e ".[test]"
	$(call install_frameworks,$(OLD_VENV)/bin)
	@rm -f $(OLD_VENV)/.installed-*
	@touch $@

# The wheels tests/gpu/run.sh installs on the GPU machine (Python 3.12, no network; torch, numpy
# and matplotlib are there): shardviz's other dependencies, downloaded into $(GPU_WHEELS) (~18 MiB).
# Run it there with the device tool: command `bash tests/gpu/run.sh`, carry [".gpu-wheels"].
GPU_WHEELS ?= .gpu-wheels
gpu-wheels: setup
	$(BIN)/python tests/gpu/wheels.py $(GPU_WHEELS)

# Python: ruff (lint + format) and mypy; the widgets' ES modules and CSS: Biome, pinned in
# package-lock.json and installed from the npm registry into node_modules/.
lint: setup $(NODE_STAMP)
	$(BIN)/python -m ruff check shardviz tests benchmarks docs _shardviz_pytest.py
	$(BIN)/python -m ruff format --check shardviz tests benchmarks docs _shardviz_pytest.py
	$(BIN)/python -m mypy
	node_modules/.bin/biome ci --error-on-warnings

$(NODE_STAMP): package.json package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo >&2 "error: npm is needed to install Biome, the widgets' JS/CSS linter. On Debian/Ubuntu: apt-get install nodejs npm"; exit 1; }
	npm ci --no-audit --no-fund
	@touch $@

notebooks: setup
	$(BIN)/python notebooks/execute.py

# The documentation site (docs/README.md), offline, warnings as errors; `make test` builds it too.
docs: setup
	$(BIN)/python docs/build_site.py --out $(DOCS_OUT)

docs-serve: setup
	$(BIN)/python docs/serve_site.py --port $(DOCS_PORT) --out $(DOCS_OUT)

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .venv-2.1[12] $(GPU_WHEELS) node_modules build dist .pytest_cache .hypothesis .mypy_cache
