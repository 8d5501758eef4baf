# The README's two commands: `make demo` and `make test`. Both create and fill a virtualenv
# ($(VENV), default .venv) on first use, then install this project (distribution jspec-jax) with
# its cpu, test, triton and lint extras: pyproject.toml is the one list of dependencies.
#
# torch on CPU: the plain index's Linux torch is the CUDA build (~527 MB plus ~20 CUDA packages,
# and torch 2.13's needs triton 3.7.1, not the 3.6 that jax-triton 0.3.1 needs). So torch is
# installed first, on its own: from the PyTorch CPU index when a 3 s probe reaches it; otherwise
# from the plain index (and pip's find-links, which on CI carries the 2.13.0 CPU wheel), so an
# unreachable CPU index costs at most the probe. The package install then finds torch satisfied.
#
# `make test-gpu` / `make bench-gpu` are for the device machine, where jax, torch and triton are
# preinstalled: they install nothing.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
STAMP = $(VENV)/.jspec-installed
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= cpu,test,triton,lint
LINT_PATHS = jspec interop tests bench examples
PYTEST_ARGS ?=

.PHONY: demo test test-gpu bench-gpu compare lint fmt clean venv

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_CPU_INDEX)" ] && timeout 4 $(VPY) -c 'import sys, urllib.request; \
	    urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=3)' "$(TORCH_CPU_INDEX)" \
	    >/dev/null 2>&1; then \
	  echo "torch $(TORCH_VERSION): from the PyTorch CPU index $(TORCH_CPU_INDEX)"; \
	  $(VPY) -m pip install -q --index-url "$(TORCH_CPU_INDEX)" "torch==$(TORCH_VERSION)"; \
	else \
	  echo "torch $(TORCH_VERSION): CPU index not reachable, plain index (+ pip find-links)"; \
	  $(VPY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jspec demo

# --max-worker-restart=0: a worker that crashes ends the run, naming its test (xdist 3.8 under
# --dist loadfile can hang forever after replacing a crashed worker: pytest-xdist #784, #1378).
test: $(STAMP)
	JAX_PLATFORMS=cpu $(VPY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 $(PYTEST_ARGS)

compare: $(STAMP)
	$(VENV)/bin/jspec compare

# Format check and lint over the whole tree (`make fmt` rewrites it); mypy over the library,
# interop and the examples (pyproject's [tool.mypy]: the annotations adopters' checkers read),
# and the examples once more under --strict (the code adopters copy).
lint: $(STAMP)
	@rc=0; \
	$(VPY) -m ruff format --check $(LINT_PATHS) || rc=1; \
	$(VPY) -m ruff check $(LINT_PATHS) || rc=1; \
	$(VPY) -m mypy || rc=1; \
	$(VPY) -m mypy --strict --follow-imports=silent examples || rc=1; \
	exit $$rc

fmt: $(STAMP)
	$(VPY) -m ruff format $(LINT_PATHS)
	$(VPY) -m ruff check --fix $(LINT_PATHS)

# Device machine: preinstalled stack, nothing installed here.
test-gpu:
	JSPEC_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR) \
	    $(PY) -m pytest -q $(PYTEST_ARGS)

bench-gpu:
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR) $(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
