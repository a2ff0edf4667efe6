# Two commands do everything: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED = 1
# The suite starts hundreds of Python processes (ranks, pytest runs, CLIs): let them reuse compiled bytecode
# (__pycache__ is git-ignored) where the environment turned its writing off.
unexport PYTHONDONTWRITEBYTECODE
# mpirun and friends live in the venv's bin/ (the mpich wheel).
export PATH := $(abspath $(VENV))/bin:$(PATH)


# every target is a command, never a file: `make site` runs although site/ exists
.PHONY: setup demo browser test check grade labs handout site site-test test-gpu lint clean

setup: $(STAMP)

# Re-install only when the pins change.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

# The website's packages (the `site` extra: Sphinx, myst-nb, furo; playwright for the browser test) and the
# peers the tests compare against (the `peers` extra: real DeepSpeed, no C++ op built, and Accelerate), and the
# code minizero was not designed around (the `outside` extra: Hugging Face transformers, tests/test_outside.py).
SITE_STAMP := $(VENV)/.site-installed
$(SITE_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,site,peers,outside]"
	@touch $(SITE_STAMP)

demo: setup
	$(PY) -m minizero demo

# Chromium, an OS package, for the browser test: installed when missing and we are root (as in CI; about
# 2 min with apt-get update); elsewhere tests/test_site.py is skipped and says how to install it.
browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium (apt-get) for tests/test_site.py"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	    || echo "could not install chromium: tests/test_site.py will be skipped"; \
	fi

# tests/test_site.py builds the site from the lessons tests/test_lessons.py just executed and opens it in
# headless Chromium (skipped, with the reason, where no Chromium is installed).
# -p tests.progress: a line per test file (its tests, seconds, the load average, the time left)
test: setup $(SITE_STAMP) browser
	$(PY) -m pytest -q -p tests.progress --durations=15

# the fast part of the suite for everyday work: no test that starts ranks or processes (about 35 s)
check: setup
	$(PY) -m pytest -q -m "not launches" --durations=5
	$(PY) -m minizero_course labs --check

grade: setup
	$(PY) -m minizero_course grade --json results.json || true  # a score below full marks is a result, not a build failure

labs: setup
	$(PY) -m minizero_course labs

# The student's copy (docs/instructors.md): `make handout HANDOUT_LABS=1-6 HANDOUT_DIR=../minizero-student`.
# Unset, the command's own default: every lab (a lab left out keeps its reference code in the handout).
HANDOUT_LABS ?=
HANDOUT_DIR  ?= build/handout
handout: setup
	rm -rf $(HANDOUT_DIR)
	$(PY) -m minizero_course handout $(HANDOUT_DIR)$(if $(HANDOUT_LABS), --labs $(HANDOUT_LABS))

# The course website in site/ (docs/site/build.py): lessons as executed in build/lessons/ (or run
# now, 2 at a time) and a short bench run (6 + 1 rounds of the same bench, marked as such on its
# page): a first build took 9 min on 2 idle cores (the lessons 6), about 3 after make test.
# BENCH=full: the bench's own 30 + 3 rounds instead (measured 237 s at load 6 without DeepSpeed's 4 candidates, where the short run took
# 106 s). Each part's time: docs/website.md.
BENCH ?= short
site: $(SITE_STAMP)
	$(PY) -m docs.site.build --bench $(BENCH)

# Every page of site/ in headless Chromium: console errors, images, links, measured numbers, search.
# It rebuilds site/ only when a source changed after the last build.
site-test: $(SITE_STAMP)
	$(PY) -m docs.site.build --if-stale --bench $(BENCH)
	MINIZERO_SITE=site $(PY) -m pytest -q tests/test_site.py

# Every lab's mechanism against DDP or one process, and its memory, on this machine's GPU: one table, and
# docs/gpu.md (tests/gpu/check.py; at most 8 minutes). No `setup` first: a lent GPU machine has no network,
# so PY may name a Python that already has a CUDA torch, mpi4py and mpich. ARGS=--quick: the CPU smoke run.
test-gpu:
	$(PY) tests/gpu/check.py $(ARGS)

lint: setup
	$(PY) -m minizero_course labs --check

clean:
	rm -rf $(VENV) results.json demo.png runs site build/lessons build/bench build/site-src build/site-doctrees build/site-test
