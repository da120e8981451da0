# The course's commands. `make help` lists them.
# `make lab` and `make test` install first when needed, so either works as the first command
# on a fresh machine that has only Python 3.11 and pip.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.DEFAULT_GOAL := help
.PHONY: help install test unit nbval nbval-portable stress execute lab lab-refresh preflight solutions lint bench gpu-check compat compat-all editions clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv with the exact pins and course_utils (editable)

# pip compiles what it installs to bytecode one file after another: installing requirements.txt
# took 88 s (78 CPU-s) with that, 46 s without, and compiling site-packages afterwards on every core
# 21 s (2 cores, 2026-11-28). The same bytecode, sooner. A file that does not compile on this Python
# (torch ships one written for 3.12) is left out, as pip leaves it out.
export COMPILE_ALL := import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path("purelib"), quiet=2, workers=0)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "Python 3.11+ is needed, found %d.%d" % v[:2])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -c "$$COMPILE_ALL"
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $@

# Unit tests and notebooks run on two more workers than the machine has cores (pytest-xdist): many
# tests wait (on ranks, a timeout, a slow save, a hang being detected), and the extra workers fill
# that time. Each worker costs CPU too (it collects every test, and starts a fork server and
# kernels). Measured on 2 cores (make test, 2026-11-27, runs of 4 and 5 workers the same day, most
# of them taken in turn): 4 workers 147-161 s, 280-306 CPU-s, 1.87-1.91 cores busy; 5 workers 144-160 s, 283-316 CPU-s,
# 1.96-1.98 cores busy. Earlier, before the fork servers preloaded the course's modules: 186 s on
# 3 workers, 164 s on 4, 155 s on 5, 159 s on 6.
# --dist loadscope keeps each notebook (and each test module) on one worker, in order;
# tests/conftest.py hands the longest scopes out first (--no-loadscope-reorder keeps that order).
WORKERS  := $(shell $(PYTHON) -c 'import os; print(2 + (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')
PARALLEL := -n $(WORKERS) --dist loadscope --no-loadscope-reorder
# One torch thread per test process and notebook kernel: with more workers than cores, torch's
# thread teams only wait for each other (measured: 353 CPU-s instead of 383, 188 s instead of 209).
# Stored outputs do not depend on it (nbval passes either way; make stress runs with the default).
TESTS_ENV := OMP_NUM_THREADS=1
# Let Python cache what it compiles: with PYTHONDONTWRITEBYTECODE set (some images set it), every
# pytest process rewrites every test module and plugin again (2 CPU-s each, measured).
unexport PYTHONDONTWRITEBYTECODE
# More pytest options for test, unit, nbval and stress: make test ARGS="--durations=10"
ARGS ?=
# pytest, with tests/early_plugin.py loaded before nbval: it keeps out an import nbval's nbformat
# pulls in and never uses (0.86 CPU-s in each pytest process, workers included).
PYTEST := $(BIN)/python -m pytest -p tests.early_plugin

test: $(STAMP) ## Unit tests and every notebook under nbval, in parallel on this machine's cores
	$(TESTS_ENV) $(PYTEST) $(PARALLEL) $(ARGS)

unit: $(STAMP) ## Unit tests only (fast)
	$(TESTS_ENV) $(PYTEST) $(PARALLEL) tests $(ARGS)

nbval: $(STAMP) ## Notebooks only, under nbval
	$(TESTS_ENV) $(PYTEST) $(PARALLEL) notebooks $(ARGS)

# Stored outputs must be what every correct CPU prints. PyTorch picks its CPU kernels by the
# processor (AVX-512, AVX2, ...), and a rounding residue printed by one set differs under another:
# ATEN_CPU_CAPABILITY=default forces the portable kernels, a second machine on this one. make stress
# (and so CI) runs the notebooks that way too, with fresh-interpreter ranks (tests/test_fresh_starts.py).
nbval-portable: $(STAMP) ## Notebooks under nbval again with PyTorch's portable CPU kernels (another CPU's rounding)
	ATEN_CPU_CAPABILITY=default $(PYTEST) $(PARALLEL) notebooks

# tests/test_fresh_starts.py runs every notebook under nbval as on another machine: ranks started as
# fresh interpreters (COURSE_START=subprocess, the start off Linux and with a GPU) and PyTorch's
# portable CPU kernels (ATEN_CPU_CAPABILITY=default), in a pytest of its own on every core.
# STRESS_TESTS narrows it (make stress STRESS_TESTS=tests/test_fresh_starts.py: every notebook once more).
STRESS_TESTS ?= tests
stress: $(STAMP) ## the tests marked stress: repeated launches, torchrun restarts, every notebook as on another machine
	$(PYTEST) -m stress $(STRESS_TESTS) $(ARGS)

execute: $(STAMP) ## Re-run every notebook in place (clean CPU run) to refresh stored outputs
	$(BIN)/python -m course_utils.tools.nbtools execute $(NOTEBOOKS)

# JupyterLab saves the outputs of every run into the notebook: it opens lab/, a git-ignored copy of
# notebooks/ (course_utils/tools/lab.py), so a learner's runs never change the tracked notebooks.
# Cloud GPU boxes and containers run as root, where Jupyter refuses to start without --allow-root.
lab: $(STAMP) ## Open the course in JupyterLab, from lab/: your copy of notebooks/, which git ignores
	$(BIN)/python -m course_utils.tools.lab
	$(BIN)/python -m jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) lab/

lab-refresh: $(STAMP) ## Make lab/ a fresh copy of the course's notebooks (the old copy moves to lab.previous/)
	$(BIN)/python -m course_utils.tools.lab --refresh

preflight: $(STAMP) ## Before a workshop: check this machine runs the course (prints READY)
	$(BIN)/python -m course_utils.tools.preflight

solutions: $(STAMP) ## Generate the solutions edition in solutions/ from course_utils/exercises (instructors)
	$(BIN)/python -m course_utils.tools.solutions solutions/ --execute

bench: $(STAMP) ## Print the performance figures (DDP scaling, ring vs gloo, launch vs torchrun, DP overhead)
	$(BIN)/python -m course_utils.tools.bench

# GPU_CHECK_JOBS: notebooks at a time, beside the gpu tests (1: one after the other).
GPU_CHECK_JOBS ?= 1
gpu-check: $(STAMP) ## On a GPU machine: the gpu tests and every notebook on the GPUs; writes gpu-check-report.md
	$(BIN)/python -m course_utils.tools.gpu_check --jobs $(GPU_CHECK_JOBS)

# Colab's torch by default; `make compat TORCH=2.13.0` checks another release. No stamp: the
# environment in .compat/ is reused, and the course is reinstalled from this checkout every time.
TORCH ?= 2.11.0
compat: ## Every notebook, every solution and the launch tests on another torch (TORCH=2.11.0, Colab's)
	$(PYTHON) -m course_utils.tools.compat_check --torch $(TORCH)

# CI's check of the other releases: Colab's and the newest that installs here, at the same time
# (each in its own environment, with its own log in .compat/; both logs printed whole at the end),
# which takes about half as long as one after the other on 2 cores.
COMPAT_RELEASES := 2.11.0 2.14.1
compat-all: ## make compat for the releases CI checks (2.11.0 and 2.14.1), side by side
	@mkdir -p .compat; pids=""; \
	for t in $(COMPAT_RELEASES); do \
	    $(MAKE) --no-print-directory compat TORCH=$$t > .compat/compat-$$t.log 2>&1 & pids="$$pids $$!"; \
	done; \
	status=0; for p in $$pids; do wait $$p || status=1; done; \
	for t in $(COMPAT_RELEASES); do echo "===== make compat TORCH=$$t"; cat .compat/compat-$$t.log; done; \
	exit $$status

# The Korean, Japanese and Chinese editions (notebooks/ko, ja, zh) from the English notebooks and
# the PO files: a changed English cell keeps its translation, flagged fuzzy; a new cell gets an
# empty entry. Run it after editing an English notebook; tests/test_editions.py fails until then.
editions: $(STAMP) ## Update the PO files from the English notebooks and rebuild notebooks/ko, ja, zh
	$(BIN)/python -m course_utils.tools.editions

# import-linter reads its contracts from pyproject.toml: the package's layers (README, Layout), one
# way down, and no import circle between modules or folders.
lint: $(STAMP) ## ruff over the package, the tests and the notebooks; the package's import layers (import-linter)
	$(BIN)/python -m ruff check .
	$(BIN)/lint-imports --no-cache

# The book: the course as an HTML site from the notebooks' stored outputs (book/build.py), checked in
# headless Chromium (book/check.py). Its tools have their own pins and venv, apart from .venv.
BOOK_VENV  := .venv-book
BOOK_STAMP := $(BOOK_VENV)/.installed
CHROMIUM   := /usr/bin/chromium
BOOK_PORT  ?= 8000
.PHONY: book book-check book-serve book-browser book-clean

# No bytecode compiled up front (see COMPILE_ALL): the book's build compiles what it imports, once.
$(BOOK_STAMP): requirements-book.txt
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "Python 3.11+ is needed, found %d.%d" % v[:2])'
	$(PYTHON) -m venv $(BOOK_VENV)
	$(BOOK_VENV)/bin/python -m pip install --quiet --no-compile -r requirements-book.txt
	@touch $@

# Debian's Chromium, and fonts for Korean, Japanese and Chinese (the translated editions, the
# language switcher, the References): without them a headless browser draws those as empty boxes,
# and book/check.py fails. Debian's fonts-noto-cjk when fontconfig finds no font for one of ko, ja,
# zh-cn. Installed when missing, as root; else what to do.
book-browser:
	@missing=""; [ -x $(CHROMIUM) ] || missing=" chromium"; \
	for lang in ko ja zh-cn; do fc-list :lang=$$lang 2>/dev/null | grep -q . || cjk=" fonts-noto-cjk"; done; \
	missing="$$missing$$cjk"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "make book-check needs Debian's$$missing, which only root can install:"; \
	    echo "  sudo apt-get update && sudo apt-get install -y$$missing"; exit 1; fi; \
	  echo "apt-get install$$missing"; apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q$$missing; \
	fi

book: $(BOOK_STAMP) ## Build the course as an HTML book in _book/site (open _book/site/index.html)
	$(BOOK_VENV)/bin/python book/build.py

# BOOK_SHOTS=no takes no screenshots: CI does (nobody sees them there; measured alone on 2 cores,
# 151 CPU-s of Chromium and check.py without them, 193 with). Every check on every page runs either way.
BOOK_SHOTS ?= yes
book-check: book book-browser ## Open every page of the book in headless Chromium (desktop, phone); the book's tests
	$(BOOK_VENV)/bin/python book/check.py $(if $(filter no,$(BOOK_SHOTS)),--no-shots)
	$(BOOK_VENV)/bin/python -m pytest -o addopts=-ra -p no:cacheprovider -p no:warnings -m book tests/test_book.py

book-serve: book ## Build the book and serve it at http://127.0.0.1:8000 (BOOK_PORT=...) until Ctrl-C
	@echo "The book: http://127.0.0.1:$(BOOK_PORT)/ (Ctrl-C stops the server)"
	$(BOOK_VENV)/bin/python -m http.server --bind 127.0.0.1 --directory _book/site $(BOOK_PORT)

book-clean:
	rm -rf $(BOOK_VENV) _book
clean: book-clean

clean: ## Remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
