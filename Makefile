# ZeRO from Scratch. The README's two commands:  make lab  (the course)  and  make test.
# Every target installs into .venv first if needed.
#
# GPU users: install a CUDA build of the same torch, e.g.
#   make lab TORCH_SPEC=torch==2.13.0+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (the +cu128 matters once a CPU build is installed: plain torch==2.13.0 is already satisfied).
# (or create the conda environment in environment.yml and run with VENV=$CONDA_PREFIX).

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PORT        ?= 8888
# make grade SUBMISSIONS=path/to/submitted LESSON=03_zero1 [NO_SANDBOX=1]
SUBMISSIONS ?= submitted
LESSON      ?=
NO_SANDBOX  ?=
PYTEST_ARGS ?=
# pytest-xdist workers (tests/conftest.py says why two on two cores); 0 runs every test in one process
TEST_WORKERS ?= 2

# the browser test (tests/test_browser.py) drives the system's Chromium
CHROMIUM    ?= /usr/bin/chromium

BIN   := $(VENV)/bin
# Stamps are named by content, not compared by file times (a fresh clone's files are all new):
# one per torch choice (changing TORCH_SPEC or TORCH_INDEX installs again), and one per
# pyproject.toml and checkout (new dependencies, or a venv shared with another clone whose
# editable install points there, install again).
checksum = $(shell printf '%s' $(1) | cksum | cut -d' ' -f1)
TORCH_STAMP := $(VENV)/.torch-$(call checksum,'$(TORCH_SPEC) $(TORCH_INDEX)')
STAMP := $(VENV)/.zerokit-$(shell cksum < pyproject.toml | cut -d' ' -f1)-$(call checksum,'$(CURDIR)')

.PHONY: setup sandbox lab demo test lessons grade grades-csv bench gpu-check clean help

help:
	@echo "make lab      install (first time) and start JupyterLab on lessons/"
	@echo "make test     install (first time) and run every test"
	@echo "make demo     a one-minute headless tour: memory and communication, measured"
	@echo "make bench    zerokit against PyTorch's own ZeRO implementations"
	@echo "make gpu-check  every CUDA path of the course on this machine's GPU, one table (installs nothing)"
	@echo "make lessons  regenerate lessons/ from solutions/ (nbgrader)"
	@echo "make grade    autograde $(SUBMISSIONS)/<student>/<lesson>/ (nbgrader), each notebook behind bubblewrap"
	@echo "make grades-csv  rewrite grades.csv from gradebook.db (e.g. after grading by hand in the formgrader)"
	@echo "make setup    only install into $(VENV)"
	@echo "make clean    remove .venv (never a VENV outside the repo) and generated files"

# torch first, pinned, so that installing the package never pulls another build.
$(TORCH_STAMP):
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@rm -f $(VENV)/.torch-* && touch $@

$(STAMP): $(TORCH_STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[course,test,dev]"
	@rm -f $(VENV)/.zerokit-* && touch $@

setup: $(STAMP)

# Chromium comes from the system's packages (a browser downloaded by a test tool would not
# run on every machine): installed here when missing and we may, else the one command to run.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Chromium for the browser test: apt-get install chromium"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
	  echo "The browser test needs Chromium. Run:  sudo apt-get install chromium   (or make test CHROMIUM=/path/to/it)"; \
	  exit 1; \
	fi

# JupyterLab refuses to run as root unless told (a container's user often is root)
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# Grading runs each notebook behind bubblewrap (Debian package bubblewrap), and `make test`
# grades example submissions: installed here when missing and we are root, else say how.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap (grading runs each notebook behind it)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	  else \
	    echo "bubblewrap is missing; install it with:  sudo apt-get install bubblewrap"; exit 1; \
	  fi; }

lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir=lessons --port=$(PORT) $(ALLOW_ROOT)

demo: setup
	$(BIN)/python -m zerokit.bench.demo

test: setup sandbox $(CHROMIUM)
	ZEROKIT_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lessons: setup
	$(BIN)/python -m zerokit.grading.lessons generate

# NO_SANDBOX=1 grades without bubblewrap: an explicit choice (see README, Grading)
grade: setup $(if $(NO_SANDBOX),,sandbox)
	$(BIN)/python -m zerokit.grading.autograde $(SUBMISSIONS) $(if $(LESSON),--lesson $(LESSON)) \
	  $(if $(NO_SANDBOX),--no-sandbox)

grades-csv: setup
	$(BIN)/python -m zerokit.grading.autograde --csv-only

bench: setup
	$(BIN)/python -m zerokit.bench

# No setup: a GPU machine has its own CUDA build of torch, and may reach no package index.
# The .venv's python if there is one (GPU_PYTHON=... picks another), else the machine's python3.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m zerokit.bench.gpu_check

clean:
	rm -rf $(if $(filter .venv,$(VENV)),$(VENV)) .pytest_cache gradebook.db autograded feedback release grades.csv bench-results test-artifacts
