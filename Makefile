# Two commands do everything: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED = 1
# mpirun and friends live in the venv's bin/ (the mpich wheel).
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup demo test grade labs lint clean

setup: $(STAMP)

# Re-install only when the pins change.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

demo: setup
	$(PY) -m minizero demo

test: setup
	$(PY) -m pytest -q --durations=15

grade: setup
	$(PY) -m minizero grade --json results.json || true  # a score below full marks is a result, not a build failure

labs: setup
	$(PY) -m minizero.cli.labgen

lint: setup
	$(PY) -m minizero.cli.labgen --check

clean:
	rm -rf $(VENV) results.json demo.png runs
