#!/usr/bin/env bash
# Everything the models need from the H200 in one call: the GPU tests of tests/models, then bench/model_bench.py.
# Logs and JSON go under $OUT (the device tool's output folder; ./out elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0  # tests/conftest.py: 0 = the real GPU
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
git rev-parse HEAD >>"$OUT/gpu.txt" 2>/dev/null
python3 -m pytest -m gpu tests/models -q -p no:cacheprovider 2>&1 | tee "$OUT/models_gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 bench/model_bench.py --out "$OUT/model_bench.json" "$@" 2>&1 | tee "$OUT/model_bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests rc=$tests, bench rc=$bench"
exit $((tests || bench))
