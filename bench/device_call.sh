#!/usr/bin/env bash
# Usage (on the device machine, from the repo root, the jax-triton wheel carried in .whl/):
#   bash bench/device_call.sh 'run NAME TIMEOUT cmd ...' ...   (each part: a shell snippet; run() logs to $OUT/NAME.txt)
# One device call: install the carried wheel, run parts each under its own timeout, logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# the caller may set XLA_PYTHON_CLIENT_PREALLOCATE (serving_size wants true): kept, else false
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false} JSPEC_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, jax_triton, triton; print('jax', jax.__version__, jax.devices(), 'triton', triton.__version__)"
run() { local name=$1 t=$2; shift 2; echo "=== $name (timeout $t)"; local t0=$(date +%s); timeout $t "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(( $(date +%s) - t0 ))s"; tail -${TAIL:-15} "$OUT/$name.txt"; }
for part in "$@"; do eval "$part"; done
