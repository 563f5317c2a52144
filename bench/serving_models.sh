#!/usr/bin/env bash
# `blink serve` of each full-size model (random weights) at saturation, isolated and with 4x-nproc hogs, then the
# transformers peer on the first PEER_PROMPTS of the same requests (0: blink only):
#   OUT=... bash bench/serving_models.sh [MODEL ...]     (default: qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
# Per model: bench/serving_gpu.sh's files in $OUT/<model>/ (on the H200 run it as `bash bench/gpu_suite.sh
# serving-models`, which bundles them into one file). PROMPTS (128),
# PEER_PROMPTS (0), LIMIT (seconds per model, 120) and BENCH_ARGS (e.g. "--output-len 64") are environment variables,
# as are serving_gpu.sh's SERVE_ARGS and CLIENT_PRIORITY.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out} PROMPTS=${PROMPTS:-128} PEER_PROMPTS=${PEER_PROMPTS:-0} LIMIT=${LIMIT:-120}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
status=0
for m in "${models[@]}"; do
  mkdir -p "$OUT/$m"
  OUT="$OUT/$m" SHAPE="$m" PROMPTS="$PROMPTS" RATES=inf PEER_PROMPTS="$PEER_PROMPTS" timeout "$LIMIT" \
    bash bench/serving_gpu.sh > "$OUT/$m/serving_models.log" 2>&1 || status=1
  echo "== $m"; grep -E "^(blink|hf) +(isolated|colocated)|^(blink|hf) @|healthy|exited" "$OUT/$m/serving_models.log"
done
exit $status
