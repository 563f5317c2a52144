#!/usr/bin/env bash
# The H200's work in two runs (each under 10 minutes):
#   bash bench/gpu_suite.sh            the benchmarks: scheduler, models (four full-size models + fused MoE, with
#                                      per-kernel profiles), engine, serving (Qwen3-8B shape, blink against
#                                      transformers, isolated and with hogs)
#   bash bench/gpu_suite.sh tests      every GPU test (pytest -m gpu: scheduler, models incl. full size, engine,
#                                      energy); `tests:tests/models` and `tests-but:tests/models` are its two halves
#   bash bench/gpu_suite.sh PART ...   any of: tests scheduler models engine serving, and these, not in the default
#                                      set: serving-models (bench/serving_models.sh; PEER_PROMPTS, BENCH_ARGS, LIMIT
#                                      as there), serving-prefix (bench/serving_prefix.sh: the prefix cache on and
#                                      off on shared-prefix workloads), moe-sweep (bench/moe_bench.py --sweep), attention
#                                      (bench/attention_bench.py), attention-sweep (the same, --sweep), ring
#                                      (bench/ring_bench.py: the agent's side of the ring, on the host's CPU) and
#                                      experiment:NAME (the one-off study bench/experiments/NAME.py, e.g.
#                                      experiment:gemv_bench, experiment:hop_costs_bench)
# Serving runs at the suite's sizes (SUITE_PROMPTS=192 requests at 16,32,64,inf req/s; SUITE_PEER_PROMPTS=8 for
# the peer) so the benchmarks fit 8 minutes; the sizes of the published results are bench/serving_gpu.sh's defaults.
# Parts write into a scratch folder that is bundled into $OUT/suite.tgz after every part (one file holds them all;
# a run cut short keeps the parts it finished); $OUT also gets gpu.txt and suite_times.txt.
# Run from the repository root of a copied tree: PYTHONPATH=src, the GPU machine's own torch/numba/cuda-python;
# copy wheels/ (ignored by git) over with the outlines-core cp312 wheel (`pip download --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d wheels outlines-core==0.2.14`) for the grammar parts.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1   # tests/conftest.py: 0 = the real GPU
FINAL=${OUT:-out}
mkdir -p "$FINAL"
OUT=$(mktemp -d)
export OUT
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(scheduler models engine serving)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
# A copied tree may carry a .git that is not its own, so its HEAD can be stale: the caller writes the commit it
# copied into the command, e.g. `BLINK_COMMIT=b157c94 bash bench/gpu_suite.sh models`.
echo "tree: ${BLINK_COMMIT:-unknown (set BLINK_COMMIT)}" >> "$OUT/gpu.txt"
# A Python bench part: `bench_part NAME MODULE ARGS... OPTION` runs `python -m bench.MODULE ARGS... OPTION
# $OUT/NAME.json` (OPTION: the script's flag for its JSON file) with its output also in $OUT/NAME.log; returns the
# script's status.
bench_part() {
  local name=$1 module=$2
  shift 2
  python -m "bench.$module" "$@" "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}
status=0
for part in "${parts[@]}"; do
  start=$SECONDS
  case "$part" in
    tests|tests:*|tests-but:*)
      # Only the files that hold GPU tests: the device-policy tests import numba's simulator, which this run turns
      # off, and the server tests need the openai client, which the GPU machine lacks (tests/test_gpu_suite.py
      # collects these files with the GPU image's packages only). `tests:PATH` keeps the files under PATH,
      # `tests-but:PATH` the others: the whole set in two runs of under 10 minutes each.
      case "$part" in
        tests:*) keep=(grep "^${part#tests:}") ;;
        tests-but:*) keep=(grep -v "^${part#tests-but:}") ;;
        *) keep=(cat) ;;
      esac
      mapfile -t files < <(bash bench/gpu_test_files.sh | "${keep[@]}")
      # The grammar tests compile with outlines-core, which the image lacks: from a copied wheels/ (else they skip).
      python -c "import outlines_core" 2>/dev/null || python -m pip install -q --no-index --find-links wheels \
        outlines-core || echo "tests: no outlines-core and no wheels/ to install it from: the grammar tests skip"
      log=gpu_tests${part#tests}
      python -m pytest -m gpu -q -p no:cacheprovider "${files[@]}" 2>&1 | tee "$OUT/${log//[:\/]/_}.log"
      rc=${PIPESTATUS[0]} ;;
    scheduler)
      bench_part scheduler_bench scheduler_bench --json; rc=$? ;;
    models)
      bash bench/models_gpu.sh moe models profile; rc=$? ;;
    engine)
      bench_part engine_bench engine_bench --json; rc=$? ;;
    serving)
      PROMPTS=${SUITE_PROMPTS:-192} PEER_PROMPTS=${SUITE_PEER_PROMPTS:-8} bash bench/serving_gpu.sh; rc=$? ;;
    serving-models)
      bash bench/serving_models.sh; rc=$? ;;
    serving-prefix)
      bash bench/serving_prefix.sh; rc=$? ;;
    moe-sweep)
      bench_part moe_sweep moe_bench --sweep --out; rc=$? ;;
    attention)
      bench_part attention_bench attention_bench --out; rc=$? ;;
    attention-sweep)
      bench_part attention_sweep attention_bench --sweep --out; rc=$? ;;
    ring)
      bench_part ring_bench ring_bench --json; rc=$? ;;
    experiment:*)
      name=${part#experiment:}
      if [ -f "bench/experiments/$name.py" ]; then
        bench_part "$name" "experiments.$name" --out; rc=$?
      else
        echo "unknown experiment: $name (no bench/experiments/$name.py)"; rc=2
      fi ;;
    *) echo "unknown part: $part (tests | tests:PATH | tests-but:PATH | scheduler | models | engine | serving | serving-models | serving-prefix |" \
         "moe-sweep | attention | attention-sweep | ring | experiment:NAME)"; rc=2 ;;
  esac
  echo "gpu_suite $part: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/suite_times.txt"
  [ "$rc" -eq 0 ] || status=1
  cp "$OUT/gpu.txt" "$OUT/suite_times.txt" "$FINAL/"
  tar -czf "$FINAL/suite.tgz.tmp" -C "$OUT" . && mv "$FINAL/suite.tgz.tmp" "$FINAL/suite.tgz"
done
exit $status
