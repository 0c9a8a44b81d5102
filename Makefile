# LongFlash entry points. A new user needs two commands (README):
#   make reproduce   the main job (today: a demo of LongFlash against PyTorch attention)
#   make test        the test suite
# Each sets itself up. If the current python3 already has what LongFlash needs
# (for example a GPU machine with torch and triton installed and no network),
# it is used as it is; otherwise a virtual environment is built in .venv once.
SHELL := /bin/bash

# Override to install another torch build, e.g. make test TORCH_SPEC="torch==2.11.0".
TORCH_SPEC ?= torch==2.13.0

HAVE_DEPS := $(shell python3 -c 'import sys, torch, numpy, pandas, pytest; \
    v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); \
    assert v >= (2, 4); sys.platform != "linux" or __import__("triton")' >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_DEPS),yes)
PYTHON ?= python3
ENV_READY :=
else
PYTHON ?= $(CURDIR)/.venv/bin/python
ENV_READY := .venv/.installed
endif

# Run from the working tree, installed or not.
export PYTHONPATH := $(CURDIR)/kernels:$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

# One command per research question; each writes results/<rq>/<device>.csv.
NOTEBOOKS := notebooks/io_complexity.ipynb notebooks/scaling.ipynb

.PHONY: test reproduce demo env figures io-complexity variants scaling
test: $(ENV_READY)
	$(PYTHON) -m pytest

reproduce: demo

demo: $(ENV_READY)
	$(PYTHON) -m experiments.demo

env: $(ENV_READY)

io-complexity: $(ENV_READY)  # RQ2: counted HBM traffic (CPU, about 1.5 min)
	$(PYTHON) -m experiments.io_complexity --full

scaling: $(ENV_READY)  # RQ3: ring attention on gloo ranks (CPU: about 30 min, up to 512K tokens; GPU: --full)
	$(PYTHON) -m experiments.scaling $(if $(shell nvidia-smi -L 2>/dev/null),--full,--long-budget-s 1800)

variants: $(ENV_READY)  # sliding-window cost against sequence length
	$(PYTHON) -m experiments.variants $(if $(shell nvidia-smi -L 2>/dev/null),--full)

figures: $(ENV_READY)  # notebooks, headless, in this order: results/ -> figures/, paper/generated/
	$(PYTHON) notebooks/run_notebooks.py $(NOTEBOOKS)

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/python -m pip install --quiet --upgrade pip
	.venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.venv/bin/python -m pip install --quiet -e ".[dev]"
	touch $@
