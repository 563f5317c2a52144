#!/usr/bin/env bash
# Everything the models need from the H200 in one call, in four parts (default: all, in this order):
#   tests   the quick GPU tests of tests/models (kernels at bf16 incl. the fused MoE, step graphs re-instantiated
#           for device launch, dense and Qwen3-MoE)
#   moe     bench/moe_bench.py: the fused MoE kernel against its reference, then its speed (Qwen3-30B-A3B layer),
#           then at 1 and 8 tokens broken down per kernel (last: replays after a profile run slower)
#   engine  the slow GPU tests: the four full-size models (random weights) served through the Engine
#   models  bench/model_bench.py: the four full-size models (Llama-3-8B, Phi-4, Qwen3-32B, Qwen3-30B-A3B)
#   fp8     bench/model_bench.py --quantization fp8: the same models with FP8 projections, per-row scales, then
#           128x128 block scales (not in the default list: `bash bench/models_gpu.sh fp8`)
#   profile the same for the steps in PROFILE (default "1,1024 64,1024 prefill") only, each broken down per kernel,
#           in a process of its own (graph replays after a CUPTI profile in the same process are slower)
#   targets the decode steps the quiet-host targets read, each profiled (not in the default list): Qwen3-0.6B and
#           Llama-3.2-1B at ctx 256 greedy and top-p (B = 1, 16, 64, 256), Qwen3-8B FP8 and Qwen3-8B verifying 4
#           drafts (B = 1, 16, 64 at ctx 1K)
#   bash bench/models_gpu.sh [tests] [moe] [engine] [models] [fp8] [profile] [targets] [-- model_bench.py arguments,
#   e.g. --models phi-4]
# Logs and JSON go under $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0  # tests/conftest.py: 0 = the real GPU
OUT=${OUT:-out}
mkdir -p "$OUT"
parts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#parts[@]} -eq 0 ] && parts=(tests moe engine models profile)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
# A copied tree may carry a .git that is not its own, so its HEAD can be stale: the caller writes the commit it
# copied into the command, e.g. `BLINK_COMMIT=b157c94 bash bench/gpu_suite.sh models`.
echo "tree: ${BLINK_COMMIT:-unknown (set BLINK_COMMIT)}" >> "$OUT/gpu.txt"
status=0

model_bench() {  # NAME ARGS...: python -m bench.model_bench ARGS, its JSON and log under $OUT as NAME; its exit status
  local name=$1; shift
  python3 -m bench.model_bench "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}

for part in "${parts[@]}"; do
  start=$SECONDS
  case "$part" in
    tests) python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/models 2>&1 \
             | tee "$OUT/models_gpu_tests.log" ;;
    engine) python3 -m pytest -q -p no:cacheprovider -m "gpu and slow" tests/models 2>&1 \
              | tee "$OUT/models_engine_tests.log" ;;
    moe) python3 -m bench.moe_bench --profile 1 8 --out "$OUT/moe_bench.json" 2>&1 | tee "$OUT/moe_bench.log" ;;
    models) python3 -m bench.model_bench --out "$OUT/model_bench.json" "$@" 2>&1 | tee "$OUT/model_bench.log" ;;
    fp8) failed=0  # the part fails if either run does
         model_bench model_bench_fp8 --quantization fp8 "$@" || failed=1
         model_bench model_bench_fp8_block --quantization fp8 --weight-block-size 128 128 "$@" || failed=1
         (exit $failed) ;;
    profile) read -ra shapes <<< "${PROFILE:-1,1024 64,1024 prefill}"
             python3 -m bench.model_bench --out "$OUT/model_bench_profile.json" --profile "${shapes[@]}" "$@" 2>&1 \
               | tee "$OUT/model_bench_profile.log" ;;
    targets) small=(--models qwen3-0.6b llama-3.2-1b --kv-gib 12 --profile 1,256 16,256 64,256 256,256)
             large=(--models qwen3-8b --kv-gib 40 --profile 1,1024 16,1024 64,1024)
             failed=0  # the part fails if any run does
             model_bench targets_small_greedy "${small[@]}" --greedy || failed=1
             model_bench targets_small_top_p "${small[@]}" || failed=1
             model_bench targets_fp8 "${large[@]}" --quantization fp8 || failed=1
             model_bench targets_drafts "${large[@]}" --drafts 4 || failed=1
             (exit $failed) ;;
    *) echo "unknown part: $part (tests | moe | engine | models | fp8 | profile | targets)"; false ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "$part: rc=$rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
