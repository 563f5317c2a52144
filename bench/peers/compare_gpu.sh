#!/usr/bin/env bash
# blink, vLLM (installed by vllm_gpu.sh) and transformers on the same `blink bench serve` workloads, isolated and
# with HOGS hogs, energy per token: one cell per run, each within 10 minutes on the H200 (vLLM's server takes
# ~2 minutes to start), into $OUT/<cell>/ (bench/serving_gpu.sh's files) and $OUT/<cell>.tgz:
#   bash bench/peers/compare_gpu.sh sweep    Poisson sweep at RATES (pre-saturation P99 TTFT / TPOT) and all at once
#                                            (inf), every request sent once before (WARMUPS): both prefix caches warm
#   bash bench/peers/compare_gpu.sh cold     the same sweep with both prefix caches off (--no-enable-prefix-caching):
#                                            the engines, not their caches
#   bash bench/peers/compare_gpu.sh closed   closed loop, 64 streams, caches off: saturation
#   bash bench/peers/compare_gpu.sh batch1   one stream (--max-concurrency 1), caches off: latency
#   bash bench/peers/compare_gpu.sh report   every cell measured so far in this OUT, side by side
# transformers' peer runs in the sweep cells only (PEER_PROMPTS requests; it is ~100x slower). Environment
# (defaults): OUT=out SHAPE=qwen3-8b PROMPTS=128 RATES=16,64,inf PEER_PROMPTS=8 HOGS=4*nproc BLINK_COMMIT (recorded).
# CPU dry run without vLLM: VLLM_PROMPTS=0 SHAPE=tiny-qwen3 DEVICE=cpu PROMPTS=8 RATES=4,inf PEER_PROMPTS=2 HOGS=2
#   BENCH_ARGS="--output-len 16" bash bench/peers/compare_gpu.sh sweep
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out} PROMPTS=${PROMPTS:-128} RATES=${RATES:-16,64,inf} PEER_PROMPTS=${PEER_PROMPTS:-8}
VLLM_PROMPTS=${VLLM_PROMPTS:-$PROMPTS} BENCH_ARGS=${BENCH_ARGS:-}
cell=${1:?usage: bash bench/peers/compare_gpu.sh sweep|cold|closed|batch1|report}
NO_CACHE=--no-enable-prefix-caching
mkdir -p "$OUT"
echo "tree: ${BLINK_COMMIT:-unknown (set BLINK_COMMIT)}; cell $cell; $(nproc) cores" >> "$OUT/compare_runs.txt"

# `run CELL VAR=VALUE ...`: bench/serving_gpu.sh into $OUT/CELL with the cell's settings, bundled after.
run() {
  local name=$1
  shift
  env OUT="$OUT/$name" PROMPTS="$PROMPTS" VLLM_PROMPTS="$VLLM_PROMPTS" PEER_TIMEOUT=150 "$@" bash bench/serving_gpu.sh
  local rc=$?
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name"
  return $rc
}

case "$cell" in
  sweep)  run sweep RATES="$RATES" PEER_PROMPTS="$PEER_PROMPTS" WARMUPS="$PROMPTS" BENCH_ARGS="$BENCH_ARGS" ;;
  cold)   run cold RATES="$RATES" PEER_PROMPTS=0 SERVE_ARGS="$NO_CACHE" VLLM_ARGS="$NO_CACHE" \
            BENCH_ARGS="$BENCH_ARGS" ;;
  closed) run closed RATES=inf PEER_PROMPTS=0 SERVE_ARGS="$NO_CACHE" VLLM_ARGS="$NO_CACHE" \
            BENCH_ARGS="--max-concurrency 64 $BENCH_ARGS" ;;
  batch1) PROMPTS=16 VLLM_PROMPTS=$((VLLM_PROMPTS > 0 ? 16 : 0)) run batch1 RATES=inf PEER_PROMPTS=0 \
            SERVE_ARGS="$NO_CACHE" VLLM_ARGS="$NO_CACHE" BENCH_ARGS="--max-concurrency 1 $BENCH_ARGS" ;;
  report)
    for name in sweep cold closed batch1; do
      results=$(ls "$OUT/$name"/serving_{blink,vllm,hf}.json 2>/dev/null)
      [ -n "$results" ] && echo "== $name" && PYTHONPATH=src python -m blink.cli bench report $results
    done | tee "$OUT/compare_report.txt" ;;
  *) echo "unknown cell: $cell (sweep | cold | closed | batch1 | report)"; exit 2 ;;
esac
