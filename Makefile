# LongFlash entry points. A new user needs two commands (README):
#   make reproduce   the main job: every experiment at the size this machine can do (CPU: well
#                    under an hour; full sizes on a GPU), then the figures, then the paper PDF
#                    (make reproduce QUICK=1: the same chain at tiny sizes, minutes)
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
PYTHON ?= .venv/bin/python
ENV_READY := .venv/.installed
endif

# Run from the working tree, installed or not. Paths in rules and commands are relative to the
# repository root (make runs every recipe there): a checkout whose path has spaces works, which
# an absolute $(CURDIR) in a target or an unquoted command word would not.
export PYTHONPATH := $(CURDIR)/kernels:$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

# One command per research question; each writes results/<rq>/<device>.csv.
NOTEBOOKS := notebooks/speedup.ipynb notebooks/io_complexity.ipynb notebooks/scaling.ipynb notebooks/long_context_training.ipynb \
             notebooks/codegen.ipynb

.PHONY: test-oldest test reproduce experiments demo env figures paper latex speedup io-complexity variants \
        scaling long-context gpu gpu-dry gpu-image-check codegen codegen-check \
        codegen-check-triton36 triton36-env test-triton36
# The suite runs on the machine's cores, at most TEST_WORKERS processes, with pytest-xdist (in
# the test extra; worksteal: idle workers take queued tests from busy ones) where it is
# installed, else in one process.
TEST_WORKERS ?= 4
test: $(ENV_READY)
	$(PYTHON) -m pytest $$($(PYTHON) -c 'import xdist' 2>/dev/null && echo "-n auto --maxprocesses $(TEST_WORKERS) --dist worksteal")

# One experiment after the other (timings must not share the machine), then the notebooks,
# then the paper. LaTeX is installed first if missing (so an install that needs you shows
# before the experiments, not after them); where it cannot be (a GPU machine with no network),
# the experiments and figures still run and the PDF is left to `make paper` on a machine with
# LaTeX, which the run says at its start and its end. On a CPU, RQ3's long-sequence part gets 5 minutes here
# (`make scaling`: 30). QUICK=1 runs the same chain at tiny sizes under build/quick/ (a few
# minutes: it proves the pipeline, its numbers mean nothing; CI runs it). Each machine writes
# its own results files and the figures draw the most recent run of each device class
# (results/README.md).
NO_LATEX_MSG := $(if $(QUICK),build/quick/,)paper/main.pdf NOT built: no LaTeX here and it could \
	not be installed; copy results/, figures/ and paper/generated/ to a machine with LaTeX and \
	run make paper there
reproduce: $(ENV_READY) $(QUICK_TREE)
	@$(MAKE) --no-print-directory latex || echo "WARNING: $(NO_LATEX_MSG)"
	$(MAKE) experiments SCALING_LONG_BUDGET_S=300
	$(MAKE) figures
	@if command -v latexmk >/dev/null; then $(MAKE) --no-print-directory paper; \
	else echo "WARNING: $(NO_LATEX_MSG)"; fi

EXPERIMENTS := speedup io-complexity scaling long-context variants
experiments: $(EXPERIMENTS)

demo: $(ENV_READY)
	$(PYTHON) -m experiments.demo

env: $(ENV_READY)

# The size of each experiment: QUICK=1 tiny, on a GPU machine the GPU sizes, else the CPU's.
GPU := $(shell nvidia-smi -L 2>/dev/null)
size = $(if $(QUICK),$(1),$(if $(GPU),$(2),$(3)))

# QUICK=1 writes everything under build/quick/ instead of the repository's results/, figures/,
# paper/generated/, executed notebooks and README table (the variables below move them; see
# notebooks/plotting.py and experiments/results.py) and builds the paper there: a trial run
# never mixes its tiny-size numbers into this machine's real results. The tree starts with the
# committed compiler report (results/codegen), which make reproduce does not regenerate.
QUICK_DIR := build/quick
ifneq ($(QUICK),)
export LONGFLASH_RESULTS := $(CURDIR)/$(QUICK_DIR)/results
export LONGFLASH_FIGURES := $(CURDIR)/$(QUICK_DIR)/figures
export LONGFLASH_GENERATED := $(CURDIR)/$(QUICK_DIR)/paper/generated
QUICK_TREE := $(QUICK_DIR)/.tree
endif
$(QUICK_DIR)/.tree:
	mkdir -p $(QUICK_DIR)/results $(QUICK_DIR)/paper/generated
	cp -r results/codegen $(QUICK_DIR)/results/
	touch $@

speedup: $(ENV_READY) $(QUICK_TREE)  # RQ1: every attention provider in one run (CPU: about 30 min on a busy 2-core machine; GPU: --full)
	$(PYTHON) -m experiments.speedup $(call size,--quick,--full,)

io-complexity: $(ENV_READY) $(QUICK_TREE)  # RQ2: counted HBM traffic (CPU, about 1.5 min)
	$(PYTHON) -m experiments.io_complexity $(call size,,--full,--full)

SCALING_LONG_BUDGET_S ?= 1800
scaling: $(ENV_READY) $(QUICK_TREE)  # RQ3: ring attention on gloo ranks (CPU: about 30 min, up to 512K tokens; GPU: --full)
	$(PYTHON) -m experiments.scaling $(call size,--quick,--full,--long-budget-s $(SCALING_LONG_BUDGET_S))

long-context: $(ENV_READY) $(QUICK_TREE)  # RQ4: max context, memory model + 7B projection, quality, MQAR (CPU: about 35 min; GPU: --full)
	$(PYTHON) -m experiments.long_context_training $(call size,--quick,--full,--quality-provider sdpa_cpu)

variants: $(ENV_READY) $(QUICK_TREE)  # sliding-window cost against sequence length
	$(PYTHON) -m experiments.variants $(call size,--quick,--full,)

# The GPU campaign (experiments/GPU.md): three stages of under 9 minutes each, a tuning stage and
# the second to fifth H100 windows' stages, each leaving OUT/stageN.tar.gz to unpack at
# the repository root. gpu-dry: the stages of GPU_DRY_STAGES (default all eight) on CPU, tiny
# (about 8 minutes for all on a 2-core machine), archives checked; CI runs some (.ci/run says
# which).
STAGE ?= 1
OUT ?= gpu-out
GPU_DRY_STAGES ?= 1 2 3 4 5 6 7 8
gpu: $(ENV_READY)
	$(PYTHON) -m experiments.gpu_campaign --stage $(STAGE) --out $(OUT)

gpu-dry: $(ENV_READY)
	set -e; d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; \
	for s in $(GPU_DRY_STAGES); do $(PYTHON) -m experiments.gpu_campaign --stage $$s --out "$$d" --dry-run; done; \
	$(PYTHON) -m experiments.gpu_campaign --check $(foreach s,$(GPU_DRY_STAGES),"$$d"/stage$(s).tar.gz)

# The GPU machines' software on this CPU (BENCHMARKING.md: Python 3.12, torch 2.11, triton 3.6,
# NumPy 2.5, transformers 5.17, JAX 0.11; no Jupyter): the test suite and the four dry stages
# with it, so a break between those versions shows before a GPU window does. Not in CI (a 4 GB
# download: torch 2.11 from PyPI is its CUDA build, which runs on a CPU too).
GPU_IMAGE := .venv-gpu-image
# The first Python 3.12 that runs: on PATH, or one pyenv installed but does not select (its
# shim then fails); or name it: make gpu-image-check GPU_IMAGE_PYTHON=/path/to/python3.12
GPU_IMAGE_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) -c "" >/dev/null 2>&1 && echo $(p))))
$(GPU_IMAGE)/.installed:
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "gpu-image-check needs Python 3.12 (the GPU" \
	    "machines' version; JAX 0.11 requires it): set GPU_IMAGE_PYTHON=/path/to/python3.12"; exit 1; }
	$(GPU_IMAGE_PYTHON) -m venv $(GPU_IMAGE)
	$(GPU_IMAGE)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_IMAGE)/bin/python -m pip install --quiet torch==2.11.0 triton==3.6.0 numpy pandas pytest \
	    transformers==5.17.0 jax==0.11.2 matplotlib seaborn
	touch $@

gpu-image-check: $(GPU_IMAGE)/.installed
	$(GPU_IMAGE)/bin/python -c "import sys, torch, triton, numpy; print(sys.version.split()[0], \
	    torch.__version__, triton.__version__, numpy.__version__)"
	$(GPU_IMAGE)/bin/python -m pytest -q
	$(MAKE) gpu-dry PYTHON=$(GPU_IMAGE)/bin/python ENV_READY=

# Code generation of the Triton kernels for sm_90a / sm_80, offline (no GPU): registers, spills,
# wgmma / TMA / cp.async counts (experiments/codegen.py). The full report compiles every
# kernel, config, head dim, dtype and variant flag, with this environment's Triton and with
# triton==3.6.0 (the version on the H100/H200 machines, in a second environment built once):
# about 40 minutes on a 2-core CPU. The check compiles the quick subset with both.
# Defined before the rules that name it: make expands a rule's prerequisites as it reads them.
TRITON36 := .venv-triton36
codegen: $(ENV_READY) $(TRITON36)/.installed
	$(PYTHON) -m experiments.codegen
	$(TRITON36)/bin/python -m experiments.codegen

# The triton==3.6.0 environment alone (CI builds it beside .venv: make -j2 env triton36-env).
triton36-env: $(TRITON36)/.installed

$(TRITON36)/.installed:
	python3 -m venv $(TRITON36)
	$(TRITON36)/bin/python -m pip install --quiet --upgrade pip
	$(TRITON36)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	# after torch, which may pin another triton: this environment is only for compiling
	$(TRITON36)/bin/python -m pip install --quiet triton==3.6.0 numpy pandas pytest hypothesis
	touch $@

# The float8 KV cache's kernels under triton==3.6.0's interpreter (the GPU machines' Triton):
# its unary minus is 0 - x, which lost -0 in the append's rounding (3.9's is a negation), a
# fault the fourth window's H100 found and this would have (about 80 s on a 2-core machine);
# and MLA's absorbed decoding (qv) on the Triton backend, float8 included, and block-sparse
# attention's and decoding's kernels (block_mask: the loops over each row's or program's list
# of visible tiles; the three about 90 s).
test-triton36: $(TRITON36)/.installed
	@# an environment built before this target had no pytest
	$(TRITON36)/bin/python -c "import pytest, hypothesis" 2>/dev/null || \
		$(TRITON36)/bin/python -m pip install --quiet pytest hypothesis
	PYTHONPATH=kernels:. TRITON_INTERPRET=1 $(TRITON36)/bin/python -m pytest -q \
		-p no:cacheprovider tests/test_kvcache.py tests/test_paged_varlen.py -k "(fp8 or float8) and triton"
	PYTHONPATH=kernels:. TRITON_INTERPRET=1 $(TRITON36)/bin/python -m pytest -q \
		-p no:cacheprovider tests/test_mla_decoding.py tests/test_block_sparse.py \
		tests/test_kvcache_block_sparse.py -k triton

# The oldest stack the library supports: torch==2.4.1 and the triton==3.0.0 it pins (with
# NumPy < 2, which Triton 3.0's interpreter needs). The Triton kernels need triton >= 3.4
# (_common.MIN_TRITON), so their tests skip and the library's tests run on the PyTorch path
# (about 2 minutes on a 2-core CPU; not in CI: PyPI's torch 2.4.1 is a CUDA build, a 3 GB
# download). The experiments, notebooks and README examples are tested on the pinned stack.
OLDEST := .venv-oldest
LIBRARY_TESTS := test_api test_correctness test_variants test_attn_mask test_headdim_v \
	test_learnable_sink test_kvcache test_paged_varlen test_cascade test_flash_attn_compat \
	test_compile test_memory test_nn test_parallel test_mla_decoding test_latent_attention
test-oldest: $(OLDEST)/.installed
	PYTHONPATH=kernels:. $(OLDEST)/bin/python -m pytest -q -n auto -p no:cacheprovider \
		-k "not scaling_experiment" $(LIBRARY_TESTS:%=tests/%.py)

$(OLDEST)/.installed:
	python3 -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet torch==2.4.1 "numpy<2" "pandas<2.3" pytest \
		pytest-xdist hypothesis
	touch $@

# triton==3.6.0's check alone (CI's: the GPU machines' Triton; tests/test_codegen.py compiles
# the kernels that matter most with this environment's Triton).
codegen-check-triton36: $(TRITON36)/.installed
	$(TRITON36)/bin/python -m experiments.codegen --quick --check

# The two Tritons' checks side by side (each compiles on one core); 3.6.0's output after.
codegen-check: $(ENV_READY) $(TRITON36)/.installed
	log=$$(mktemp); rc=0; \
	$(TRITON36)/bin/python -m experiments.codegen --quick --check >"$$log" 2>&1 & pid=$$!; \
	$(PYTHON) -m experiments.codegen --quick --check || rc=$$?; \
	wait $$pid || rc=$$?; echo "== triton==3.6.0, run beside the above:"; cat "$$log"; rm -f "$$log"; \
	exit $$rc

figures: $(ENV_READY) $(QUICK_TREE)  # notebooks, headless, in this order: results/ -> figures/, paper/generated/, README table
	$(PYTHON) notebooks/run_notebooks.py $(if $(QUICK),--out-dir $(QUICK_DIR)/notebooks) $(NOTEBOOKS)
	$(if $(QUICK),cp README.md $(QUICK_DIR)/README.md)
	$(PYTHON) notebooks/readme_table.py $(if $(QUICK),--readme $(QUICK_DIR)/README.md)

# paper/main.pdf from the committed (or just regenerated) figures and paper/generated/
# (QUICK=1: build/quick/paper/main.pdf from build/quick/).
# -Werror: an undefined reference or citation fails the build, like a LaTeX error.
# max_print_line: latexmk reads main.log for "No file main.bbl." to decide to run bibtex, and
# misses it when TeX wrapped the line before it at 79 characters (seen with long figure names).
paper: latex $(QUICK_TREE)
	$(if $(QUICK),cp -r paper/main.tex paper/refs.bib paper/sections $(QUICK_DIR)/paper/)
	cd $(if $(QUICK),$(QUICK_DIR)/paper,paper) && max_print_line=10000 latexmk -pdf -interaction=nonstopmode -halt-on-error -file-line-error -Werror main.tex

# LaTeX for the paper: installed with apt (sudo when not root) if latexmk is missing.
LATEX_PACKAGES := texlive-latex-base texlive-latex-recommended texlive-latex-extra \
	texlive-fonts-recommended texlive-science latexmk
latex:
	@command -v latexmk >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  command -v apt-get >/dev/null && { [ -z "$$sudo" ] || command -v sudo >/dev/null; } || { \
	    echo "The paper needs LaTeX: install latexmk and $(LATEX_PACKAGES), then rerun."; \
	    exit 1; }; \
	  echo "Installing LaTeX for the paper: $$sudo apt-get install -y $(LATEX_PACKAGES)"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
	    $(LATEX_PACKAGES) >/dev/null; }

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/python -m pip install --quiet --upgrade pip
	.venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.venv/bin/python -m pip install --quiet -e ".[dev]"
	touch $@
