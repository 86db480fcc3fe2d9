#!/usr/bin/env bash
# The GPU-relevant tests on the GPU itself: kernels, tree, verify, sampling, engine and models, with
# JAX_PLATFORMS=cuda (tests/conftest.py sets cpu unless the variable is set, so without it a GPU machine
# silently tests the CPU). Uses the Python on PATH (the GPU machine's own environment); no install.
#   scripts/test_gpu.sh                      # the default selection: "not slow or gpu" (the kernels'
#                                            # slow-on-CPU tests, fast compiled, are marked gpu)
#   scripts/test_gpu.sh tests/kernels -m ""  # any pytest arguments replace the default selection
# The log goes to $OUT/test_gpu.log ($OUT: the device machine's output folder), else gpu-test-logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
log_dir="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$log_dir"
log="$log_dir/test_gpu.log"
python - <<'PY' || { echo "error: JAX sees no GPU (JAX_PLATFORMS=cuda)" >&2; exit 2; }
import jax
assert jax.default_backend() == "gpu", jax.default_backend()
print("devices:", jax.devices())
PY
if [ "$#" -eq 0 ]; then
  set -- tests/kernels tests/tree tests/verify tests/sampling tests/engine tests/models -m "not slow or gpu" -n 4 -q
fi
python -m pytest -p no:cacheprovider -p no:benchmark -o addopts="" --timeout=600 "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo "log: $log (pytest exit $status)"
exit "$status"
