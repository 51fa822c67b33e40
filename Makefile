# Each target sets up its own virtualenv first (.venv), then runs.
# On other machines override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokengym-installed

.PHONY: venv test demo bench lint clean

venv: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $(STAMP)

lint: venv
	$(PY) -m ruff check .

test: venv lint
	$(PY) -m pytest -q

demo: venv
	$(PY) -m tokengym demo

bench: venv
	$(PY) -m pytest benchmarks/ --benchmark-only -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
