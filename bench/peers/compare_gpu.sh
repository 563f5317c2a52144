#!/usr/bin/env bash
# blink, vLLM (installed by vllm_gpu.sh) and transformers on the same `blink bench serve` workloads, isolated and
# with HOGS hogs, energy per token: three cells, one run each, each within 10 minutes on the H200, into
# $OUT/<cell>/ (bench/serving_gpu.sh's files) and $OUT/<cell>.tgz:
#   bash bench/peers/compare_gpu.sh warm     blink and vLLM: Poisson sweep at RATES (pre-saturation P99 TTFT / TPOT)
#                                            and all at once (inf), every request sent once before each condition
#                                            (WARMUPS): both prefix caches warm (~7 min: vLLM's first start ~150 s)
#   bash bench/peers/compare_gpu.sh cold     blink and vLLM, both prefix caches off (--no-enable-prefix-caching): the
#                                            engines and not their caches, from one start of each server: the sweep,
#                                            a closed loop of 64 streams (saturation) and one stream of 16 requests
#                                            (latency) (~9 min: vLLM's second start ~115 s, its colocated runs ~4 min)
#   bash bench/peers/compare_gpu.sh fp8      the cold cell with both servers at --quantization fp8 (weights quantized
#                                            per channel at load, activations per token; KV bf16 in both)
#   bash bench/peers/compare_gpu.sh structured  the cold cell's closed loop of 64 streams twice, plain and with every
#                                            answer following bench/schemas/record.json (response_format
#                                            json_schema), over the shape with a byte-level tokenizer, no hogs, EOS
#                                            honoured in both (a grammar needs it); WARMUPS=8 compile the schema first
#   bash bench/peers/compare_gpu.sh peer     transformers' continuous batching on PEER_PROMPTS requests (~4 min)
#   bash bench/peers/compare_gpu.sh report   every cell measured so far in this OUT, side by side, and every run as a
#                                            Markdown row ($OUT/compare_table.md)
# Environment (defaults): OUT=out SHAPE=qwen3-8b PROMPTS=128 RATES=16,64,inf PEER_PROMPTS=8 HOGS=4*nproc
#   COLD_RUNS (the cold cell's runs, serving_gpu.sh's RUNS: the sweep, the closed loop, one stream; fewer for a larger
#   shape, e.g. SHAPE=qwen3-30b-a3b COLD_RUNS="closed:--sweep inf --max-concurrency 64" in an OUT of its own)
#   WARMUPS (0; serving_gpu.sh's: with the caches off, warm-up requests fill no cache): give the MoE shape
#   WARMUPS=$PROMPTS, since vLLM compiles its fused-MoE Triton kernel for the first mixed batches it meets (a 1.6 s
#   stall inside an unwarmed run); VLLM_PROMPTS=0 or PROMPTS=0 runs one server alone, to split a cell over two runs
#   BLINK_ARGS (more `blink serve` options in every cell, e.g. "--cuda-graph-sizes 1 2 4 8 16 24 32 ...") and
#   VLLM_MORE_ARGS (more `vllm serve` options in every cell, e.g. "--kv-cache-dtype fp8" beside BLINK_ARGS' own)
#   BLINK_COMMIT (recorded). CPU dry run without vLLM: VLLM_PROMPTS=0 SHAPE=tiny-qwen3 DEVICE=cpu PROMPTS=8
#   RATES=4,inf PEER_PROMPTS=2 HOGS=2 BENCH_ARGS="--output-len 16" bash bench/peers/compare_gpu.sh cold
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out} PROMPTS=${PROMPTS:-128} RATES=${RATES:-16,64,inf} PEER_PROMPTS=${PEER_PROMPTS:-8}
VLLM_PROMPTS=${VLLM_PROMPTS:-$PROMPTS} BENCH_ARGS=${BENCH_ARGS:-} BLINK_ARGS=${BLINK_ARGS:-}
VLLM_MORE_ARGS=${VLLM_MORE_ARGS:-}
cell=${1:?usage: bash bench/peers/compare_gpu.sh warm|cold|fp8|structured|peer|report}
NO_CACHE=--no-enable-prefix-caching
COLD_RUNS=${COLD_RUNS:-"sweep:;closed:--sweep inf --max-concurrency 64;batch1:--sweep inf --max-concurrency 1 \
--num-prompts 16"}
mkdir -p "$OUT"
echo "tree: ${BLINK_COMMIT:-unknown (set BLINK_COMMIT)}; cell $cell; shape ${SHAPE:-qwen3-8b}; $(nproc) cores" \
  >> "$OUT/compare_runs.txt"

# `run CELL VAR=VALUE ...`: bench/serving_gpu.sh into $OUT/CELL with the cell's settings, bundled after.
run() {
  local name=$1
  shift
  env OUT="$OUT/$name" PROMPTS="$PROMPTS" VLLM_PROMPTS="$VLLM_PROMPTS" RATES="$RATES" BENCH_ARGS="$BENCH_ARGS" \
    "$@" bash bench/serving_gpu.sh
  local rc=$?
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name"
  return $rc
}

case "$cell" in
  warm) run warm PEER_PROMPTS=0 WARMUPS="$PROMPTS" SERVE_ARGS="$BLINK_ARGS" VLLM_ARGS="$VLLM_MORE_ARGS" ;;
  cold) run cold PEER_PROMPTS=0 SERVE_ARGS="$NO_CACHE $BLINK_ARGS" VLLM_ARGS="$NO_CACHE $VLLM_MORE_ARGS" \
    RUNS="$COLD_RUNS" ;;
  fp8) run fp8 PEER_PROMPTS=0 SERVE_ARGS="$NO_CACHE --quantization fp8 $BLINK_ARGS" \
    VLLM_ARGS="$NO_CACHE --quantization fp8 $VLLM_MORE_ARGS" RUNS="$COLD_RUNS" ;;
  structured) run structured PEER_PROMPTS=0 HOGS=0 TOKENIZER=bytes WARMUPS=8 SERVE_ARGS="$NO_CACHE $BLINK_ARGS" \
    VLLM_ARGS="$NO_CACHE $VLLM_MORE_ARGS" RUNS="plain:--sweep inf --max-concurrency 64 --no-ignore-eos;json:--sweep \
inf --max-concurrency 64 --no-ignore-eos --json-schema bench/schemas/record.json" ;;
  peer) run peer PROMPTS=0 VLLM_PROMPTS=0 PEER_PROMPTS="$PEER_PROMPTS" PEER_TIMEOUT=400 ;;
  report)
    for report in "$OUT"/{warm,cold,fp8,structured,peer}/serving_report*.txt; do
      [ -e "$report" ] && echo "== $report" && cat "$report"
    done | tee "$OUT/compare_report.txt"
    # Every run as one Markdown row, as docs/benchmarks/peers.md's tables have them, one table per cell.
    for name in warm cold fp8 structured peer; do
      results=$(ls "$OUT/$name"/serving_*.json 2>/dev/null)
      [ -n "$results" ] && echo "### $name" && echo && PYTHONPATH=src python -m blink.cli bench report $results \
        --markdown && echo
    done | tee "$OUT/compare_table.md" ;;
  *) echo "unknown cell: $cell (warm | cold | fp8 | structured | peer | report)"; exit 2 ;;
esac
