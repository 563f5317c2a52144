#!/usr/bin/env bash
# The H200's work in two calls (each under the device tool's 10 minutes), logs and JSON under $OUT:
#   bash bench/gpu_suite.sh            the benchmarks: scheduler, models (four full-size models + fused MoE), engine,
#                                      serving (Qwen3-8B shape, blink against transformers, isolated and with hogs)
#   bash bench/gpu_suite.sh tests      every GPU test (pytest -m gpu: scheduler, models incl. full size, engine,
#                                      energy)
#   bash bench/gpu_suite.sh PART ...   any of: tests scheduler models engine serving
# Serving runs at the suite's sizes (SUITE_PROMPTS=192 requests at 16,32,64,inf req/s; SUITE_PEER_PROMPTS=24 for
# the peer) so the benchmarks fit 8 minutes; the sizes of the published results are bench/serving_gpu.sh's defaults.
# Run from the repository root of a copied tree: PYTHONPATH=src, the device's own torch/numba/cuda-python.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1   # tests/conftest.py: 0 = the real GPU
OUT=${OUT:-out}
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(scheduler models engine serving)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
status=0
for part in "${parts[@]}"; do
  start=$SECONDS
  case "$part" in
    tests)
      python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
      rc=${PIPESTATUS[0]} ;;
    scheduler)
      python bench/scheduler_bench.py --json "$OUT/scheduler_bench.json" 2>&1 | tee "$OUT/scheduler_bench.log"
      rc=${PIPESTATUS[0]} ;;
    models)
      bash bench/models_gpu.sh moe models -- --profile 1,1024 64,1024 prefill; rc=$? ;;
    engine)
      python bench/engine_bench.py --json "$OUT/engine_bench.json" 2>&1 | tee "$OUT/engine_bench.log"
      rc=${PIPESTATUS[0]} ;;
    serving)
      PROMPTS=${SUITE_PROMPTS:-192} PEER_PROMPTS=${SUITE_PEER_PROMPTS:-24} bash bench/serving_gpu.sh; rc=$? ;;
    *) echo "unknown part: $part (tests | scheduler | models | engine | serving)"; rc=2 ;;
  esac
  echo "gpu_suite $part: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/suite_times.txt"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
