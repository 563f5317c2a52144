#!/usr/bin/env bash
# One call on the H200 runs the GPU tests and benchmarks and writes JSON and logs under $OUT:
#   bench/gpu_suite.sh [scheduler] [models] [engine] [serving] ...      (no argument: everything)
# Run from the repository root of a copied tree: PYTHONPATH=src, the device's own torch/numba/cuda-python.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(scheduler models engine serving)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
status=0
for part in "${parts[@]}"; do
  case "$part" in
    scheduler)
      python -m pytest -m gpu -x -q -s -p no:cacheprovider tests/device/test_launch.py 2>&1 | tee "$OUT/scheduler_tests.log" || status=1
      python bench/scheduler_bench.py --json "$OUT/scheduler_bench.json" 2>&1 | tee "$OUT/scheduler_bench.log" || status=1
      ;;
    models)
      bash bench/models_gpu.sh || status=1
      ;;
    engine)
      python -m pytest -m gpu -x -q -s -p no:cacheprovider tests/test_engine.py 2>&1 | tee "$OUT/engine_tests.log" || status=1
      python bench/engine_bench.py --json "$OUT/engine_bench.json" 2>&1 | tee "$OUT/engine_bench.log" || status=1
      ;;
    serving)
      python -m pytest -m gpu -q -p no:cacheprovider tests/bench/test_energy.py 2>&1 | tee "$OUT/serving_tests.log" || status=1
      bash bench/serving_gpu.sh || status=1
      ;;
    *) echo "unknown part: $part (scheduler | models | engine | serving)"; status=2 ;;
  esac
done
exit $status
