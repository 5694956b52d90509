# Two set-up commands (see README.md): `make demo` and `make test`. Both create the virtual
# environment first if needed. Nothing here is hidden from a new user: CI runs `.ci/run`, which is
# exactly the README's test commands (make test, make test-slurm, make docs, make test-wheel, ...).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

# The tests start hundreds of fresh interpreters (launchers, workers, notebook kernels). Where
# PYTHONDONTWRITEBYTECODE is set (as on the project's machines) each of them compiles anyaccel's
# and the tests' sources again (~0.1 s of CPU per process); here Python keeps its bytecode in
# __pycache__/ (ignored by git, left out of the sdist: MANIFEST.in), as an installed package has it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast test-slow test-xla test-slurm test-cluster test-wheel docs docs-html docs-deps bench gpu-check gpu-wheels clean soak

setup: $(VENV)/.installed

# --no-compile: pip would compile every module of every package (~20,000 files, ~90 CPU-s, on
# `make setup`'s serial path); the interpreters compile what they import and keep it in
# __pycache__/ (PYTHONDONTWRITEBYTECODE is unexported above), a few thousand modules. Outside make,
# where PYTHONDONTWRITEBYTECODE=1 is set (the project's machines), .venv's interpreters compile again,
# at every start, whatever no make target has imported yet (`import torch`: ~4.6 CPU-s).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile --upgrade pip
	$(PIP) install -q --no-compile -c constraints.txt -e ".[test,examples,docs]"
	touch $@

demo: setup
	$(VENV)/bin/anyaccel launch --num_processes 2 --cpu examples/train_digits.py --epochs 8

# mypy's cache outside the checkout, so that a fresh clone on the same machine reuses what it knows
# of torch's own modules (cold: ~2 CPU-minutes; warm: seconds); mypy checks each cached module
# against its source, so a stale cache costs time, never a missed error. MYPY_CACHE=.mypy_cache: in the checkout.
MYPY_CACHE ?= $(HOME)/.cache/anyaccel/mypy

# pytest on PYTEST_WORKERS processes (pytest-xdist; 0: in one process), whole files to a worker
# (--dist loadfile: a module's launched job runs once), the long multi-process files handed out
# first (tests/conftest.py): on 2 cores one worker's job waits (rendezvous, timeouts, a doctor's
# interval) while the other computes, and the unit tests fill the end. --no-loadscope-reorder:
# xdist 3.x otherwise hands out the files with the MOST TESTS first, whatever the collection order
# says (the soak, 2 tests and ~10 minutes in one worker, went out 89th of 114 files).
# docs/contributing/testing.md
# 2 workers: 3 were measured on 2026-11-29 (two whole .ci/runs here): the same throughput
# (the tests pytest had finished by each minute, counted in CPU-s of the 2-worker run, within 3 %)
# because every process then took 15-25 % more CPU-s for the same work (the cores are shared,
# not idle); 2 keep the load, memory and timing margins lower. docs/contributing/testing.md.
PYTEST_WORKERS ?= 2
# The cluster and SLURM tests are make test-cluster's and make test-slurm's (deselected here, not
# skipped: .ci/run runs those beside make test, and a test of tests/cluster reached while the
# cluster of make test-cluster, or one started by hand, is up would run against it).
test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	MYPY_CACHE_DIR=$(MYPY_CACHE) $(VENV)/bin/mypy
	$(PY) -m pytest -q -m "not jit_ops and not cluster and not slurm" -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -m slow

# The soak (not in CI): every canonical shape of a user's script as a fresh job, 200 times each,
# two at a time, printing runs / hangs / failures / survivors per shape (tests/soak/soak.py).
# `make test` runs the same shapes 20 times each (tests/soak/test_soak_multiprocess.py).
SOAK_RUNS ?= 200
soak: setup
	$(PY) tests/soak/soak.py --runs $(SOAK_RUNS)

# A real one-node SLURM (root; installs slurm-wlm + munge with apt the first time), the SLURM tests
# against it, then the cluster stopped again whatever the tests did.
SLURM_DIR ?= /var/tmp/anyaccel-slurm
test-slurm: setup
	bash scripts/slurm_cluster.sh start
	SLURM_CONF=$(SLURM_DIR)/slurm.conf $(PY) -m pytest -q -m slurm tests/slurm; \
	status=$$?; bash scripts/slurm_cluster.sh stop; exit $$status

# A private two-host cluster on this machine (root: network namespaces, scripts/cluster.sh), the
# cluster tests against it (tests/cluster/test_slurm_two_nodes.py starts a SLURM of two nodes on it,
# installing slurm-wlm + munge with apt the first time), then every host, daemon and process
# removed again whatever the tests did.
test-cluster: setup
	bash scripts/cluster.sh start
	$(PY) -m pytest -q -m cluster tests/cluster; \
	status=$$?; bash scripts/cluster.sh stop; exit $$status

# torch 2.9 + torch-xla in a virtual environment outside the checkout (like mypy's cache); its own CI
# step (.ci/run runs it beside make setup, which it does not need, and before make test-wheel, which
# links torch 2.9 from this environment). A fresh clone on the same machine, as CI's is, finds it complete in seconds
# instead of installing ~3 GB of wheels again (minutes); anyaccel is this checkout's (PYTHONPATH
# first, so the script installs no editable copy into it). XLA_VENV=.venv-xla: in the checkout.
XLA_VENV ?= $(HOME)/.cache/anyaccel/venv-xla
test-xla:
	PYTHONPATH=$(CURDIR) XLA_VENV=$(XLA_VENV) bash scripts/setup_xla_venv.sh
	PYTHONPATH=$(CURDIR) PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/xla -m xla

# The test suite against the installed WHEEL (not the checkout) on the oldest supported torch (2.9.0),
# in a fresh virtual environment under build/wheel-test (scripts/test_wheel.sh says how); torch 2.9 is
# hard-linked from test-xla's environment (XLA_VENV) when that has it, instead of downloaded again.
test-wheel: setup
	XLA_VENV=$(XLA_VENV) bash scripts/test_wheel.sh

# The docs site (docs/contributing/docs.md): built with warnings as errors into docs/_build/html,
# then checked: the generated reference against the code, the figures against their results files,
# every complete script in the docs runs, and headless Chromium (apt-installed when missing; root)
# searches the site, measures every page at 1280 px and takes screenshots of five (apt waits for the
# package lock: .ci/run runs make test-cluster beside it, which may install SLURM). Every step runs
# with HOME and the XDG directories in docs/_build/home: nothing lands in your home directory.
DOCS_HTML ?= docs/_build/html
DOCS_HOME  = $(CURDIR)/docs/_build/home
DOCS_ENV   = HOME=$(DOCS_HOME) XDG_CACHE_HOME=$(DOCS_HOME)/.cache XDG_CONFIG_HOME=$(DOCS_HOME)/.config \
             XDG_DATA_HOME=$(DOCS_HOME)/.local/share MPLCONFIGDIR=$(DOCS_HOME)/.config/matplotlib
docs: docs-html
	$(DOCS_ENV) $(PY) -m pytest -q -p no:cacheprovider tests/project/test_docs_reference.py \
	  tests/project/test_docs_figures.py tests/project/test_docs_pages.py
	$(DOCS_ENV) $(PY) docs/check_examples.py
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { echo "make docs: installing chromium with apt (root needed)"; apt-get -o DPkg::Lock::Timeout=600 update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null; }
	$(DOCS_ENV) $(PY) docs/check_site.py --html $(DOCS_HTML)

docs-html: docs-deps
	rm -rf $(DOCS_HTML)
	$(DOCS_ENV) $(PY) -m sphinx -E -W --keep-going -q -b html docs $(DOCS_HTML)

# The `docs` extra of pyproject.toml, installed without reinstalling anyaccel itself.
docs-deps: setup
	@mkdir -p $(DOCS_HOME)
	@$(PY) -c "import sphinx, myst_parser, furo" 2>/dev/null || $(DOCS_ENV) $(PIP) install -q -c constraints.txt \
	  $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")

bench: setup
	$(PIP) install -q -c constraints.txt -r benchmarks/requirements.txt
	$(PY) -m benchmarks

# On a machine with a CUDA GPU: every GPU check and the GPU benchmark in one command (~10 min on one
# H100), with the machine's own torch (never replaced) and no download; writes gpu-check-results.md.
# Without a GPU it says so and runs nothing. Python: GPU_PYTHON=... (or PYTHON in the environment),
# else the first python3/python that imports torch. GPU_CHECK_STEPS=fsdp,bench reruns only those steps.
gpu-check:
	$(if $(GPU_PYTHON),PYTHON=$(GPU_PYTHON) )bash scripts/gpu_check.sh

# The wheels gpu-check may need, for a GPU machine without internet (.gpu-wheels/, carried there).
gpu-wheels:
	PYTHON=$(PYTHON) bash scripts/gpu_wheels.sh

clean:
	rm -rf $(VENV) .venv-xla .pytest_cache build dist *.egg-info docs/_build docs/reference/generated
	find . -name __pycache__ -prune -not -path "./.git/*" -exec rm -rf {} +
