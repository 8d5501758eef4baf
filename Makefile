# The README's two commands: `make demo` and `make test`. Both create and fill a local .venv on
# first use. On CPU, torch is pinned to the local 2.13.0 CPU build: an unpinned torch would pull
# several GB of CUDA wheels. `make test-gpu` is for the device machine, where jax, torch and triton
# are preinstalled: it installs nothing and runs the suite with kernels compiled for the GPU.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.jspec-installed
PYTEST_ARGS ?=

.PHONY: demo test test-gpu bench bench-gpu compare lint clean venv

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q "jax==0.10.2" "jaxlib==0.10.2" chex numpy pytest hypothesis \
	    pytest-xdist "triton==3.6.0" "jax-triton==0.3.1"
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) -m jspec.cli demo

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VPY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

compare: $(STAMP)
	$(VPY) -m jspec.cli compare

# Device machine: preinstalled stack, nothing installed here.
test-gpu:
	JSPEC_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR) \
	    $(PY) -m pytest -q $(PYTEST_ARGS)

bench-gpu:
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$(CURDIR) $(PY) -m bench.run_all

lint: $(STAMP)
	$(VPY) -m pip install -q ruff && $(VPY) -m ruff check jspec interop tests bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
