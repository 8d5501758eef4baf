#!/usr/bin/env bash
# One full device-machine pass: GPU test suite (kernels compiled, not interpreted) + all benches.
# Usage on the device (from the repo root, with .whl carried):  bash bench/device_run.sh [pytest args]
# Writes $OUT/test-gpu.log, $OUT/bench.md and $OUT/e2e-split.md (bench.e2e rerun with XLA's
# command buffers off, so its device split of the fused step into model vs bookkeeping is exact).
set -uo pipefail
OUT=${OUT:-/tmp/jspec-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, torch, triton; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'triton', triton.__version__)"
JSPEC_TEST_GPU=1 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/test-gpu.log" | tail -30
timeout ${BENCH_TIMEOUT:-480} python3 -m bench.run_all ${BENCH_ARGS:-} --out "$OUT/bench.md"
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=" \
  timeout ${SPLIT_TIMEOUT:-300} python3 -m bench.e2e --out "$OUT/e2e-split.md"
