#!/usr/bin/env bash
# `blink serve` of each full-size model (random weights) at saturation, isolated and with 4x-nproc hogs, blink only:
#   OUT=... bash bench/serving_models.sh [MODEL ...]     (default: qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
# Per model: $OUT/<model>/serving_blink.json and the rest of bench/serving_gpu.sh's files. PROMPTS (128) and
# LIMIT (seconds per model, 120) are environment variables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out} PROMPTS=${PROMPTS:-128} LIMIT=${LIMIT:-120}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
status=0
for m in "${models[@]}"; do
  mkdir -p "$OUT/$m"
  OUT="$OUT/$m" SHAPE="$m" PROMPTS="$PROMPTS" RATES=inf PEER_PROMPTS=0 timeout "$LIMIT" bash bench/serving_gpu.sh \
    > "$OUT/$m/serving_models.log" 2>&1 || status=1
  echo "== $m"; grep -E "^blink +(isolated|colocated)|^blink @|healthy|exited" "$OUT/$m/serving_models.log"
done
exit $status
