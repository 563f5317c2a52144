#!/usr/bin/env bash
# `blink serve` of each full-size model (random weights) at saturation, isolated and with 4x-nproc hogs, then the
# transformers peer on the first PEER_PROMPTS of the same requests (0: blink only):
#   OUT=... bash bench/serving_models.sh [MODEL ...]     (default: qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
# Per model: $OUT/serving_<model>_{blink,hf}.json and $OUT/serving_<model>.log. PROMPTS (128),
# PEER_PROMPTS (0), LIMIT (seconds per model, 120) and BENCH_ARGS (e.g. "--output-len 64") are environment variables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out} PROMPTS=${PROMPTS:-128} PEER_PROMPTS=${PEER_PROMPTS:-0} LIMIT=${LIMIT:-120}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b)
status=0
for m in "${models[@]}"; do
  # Each model's run writes into a scratch folder; only its JSONs and log come back (the device tool returns a
  # limited number of files).
  work=$(mktemp -d)
  OUT="$work" SHAPE="$m" PROMPTS="$PROMPTS" RATES=inf PEER_PROMPTS="$PEER_PROMPTS" timeout "$LIMIT" \
    bash bench/serving_gpu.sh > "$OUT/serving_${m}.log" 2>&1 || status=1
  for json in "$work"/serving_blink.json "$work"/serving_hf.json; do
    [ -f "$json" ] && cp "$json" "$OUT/serving_${m}_$(basename "$json" .json | cut -d_ -f2).json"
  done
  echo "== $m"; grep -E "^(blink|hf) +(isolated|colocated)|^(blink|hf) @|healthy|exited" "$OUT/serving_${m}.log"
done
exit $status
