# Two commands do everything: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED = 1
# mpirun and friends live in the venv's bin/ (the mpich wheel).
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup demo test grade labs lint handout site site-test clean

setup: $(STAMP)

# Re-install only when the pins change.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

# The website's packages (the `site` extra: Sphinx, myst-nb, furo; playwright for the browser test).
SITE_STAMP := $(VENV)/.site-installed
$(SITE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,site]"
	@touch $(SITE_STAMP)

demo: setup
	$(PY) -m minizero demo

# tests/test_site.py builds the site from the lessons tests/test_lessons.py just executed and opens it in
# headless Chromium (skipped, with the reason, where no Chromium is installed).
test: setup $(SITE_STAMP)
	$(PY) -m pytest -q --durations=15

grade: setup
	$(PY) -m minizero grade --json results.json || true  # a score below full marks is a result, not a build failure

labs: setup
	$(PY) -m minizero.cli.labgen

# The student's copy (docs/instructors.md): `make handout HANDOUT_LABS=1-6 HANDOUT_DIR=../minizero-student`.
HANDOUT_LABS ?= 1-12
HANDOUT_DIR  ?= build/handout
handout: setup
	rm -rf $(HANDOUT_DIR)
	$(PY) -m minizero handout $(HANDOUT_DIR) --labs $(HANDOUT_LABS)

# The course website in site/ (docs/site/build.py): lessons as executed in build/lessons/ (or run now).
site: $(SITE_STAMP)
	$(PY) -m docs.site.build

# Every page of site/ in headless Chromium: console errors, images, links, measured numbers, search.
site-test: site
	MINIZERO_SITE=site $(PY) -m pytest -q tests/test_site.py

lint: setup
	$(PY) -m minizero.cli.labgen --check

clean:
	rm -rf $(VENV) results.json demo.png runs site build/lessons build/bench build/site-src build/site-doctrees build/site-test
