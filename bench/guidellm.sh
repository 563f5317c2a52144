#!/usr/bin/env bash
# GuideLLM 0.8.1 (the load generator the Blink paper measured with) against `blink serve`, offline: GuideLLM counts
# tokens with the served model's own tokenizer, named by directory (--tokenizer kind=huggingface_auto,model=DIR),
# so it never asks the Hugging Face hub for the served name (HF_HUB_OFFLINE=1 makes any such attempt an error).
# A constant RATE req/s for REQUESTS requests of synthetic text (PROMPT_TOKENS in, OUTPUT_TOKENS out), through
# REQUEST_FORMAT. Writes $OUT/guidellm.json (GuideLLM's report), $OUT/guidellm.log and $OUT/blink_serve.log.
#
# Environment (defaults): GUIDELLM=guidellm (its own venv: pip install guidellm==0.8.1) MODEL_DIR=the embedded
#   SmolLM2's converted directory RATE=1 REQUESTS=5 PROMPT_TOKENS=64 OUTPUT_TOKENS=16
#   REQUEST_FORMAT=/v1/chat/completions PORT=8431 SERVE_ARGS="" (more `blink serve` options, e.g. --device cpu)
# e.g. GUIDELLM=/tmp/guidellm-venv/bin/guidellm SERVE_ARGS="--device cpu" OUT=out bash bench/guidellm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-out} GUIDELLM=${GUIDELLM:-guidellm} RATE=${RATE:-1} REQUESTS=${REQUESTS:-5}
PROMPT_TOKENS=${PROMPT_TOKENS:-64} OUTPUT_TOKENS=${OUTPUT_TOKENS:-16} PORT=${PORT:-8431}
REQUEST_FORMAT=${REQUEST_FORMAT:-/v1/chat/completions} SERVE_ARGS=${SERVE_ARGS:-}
MODEL_DIR=${MODEL_DIR:-$(python -c "from blink.models import default_model_path; print(default_model_path())")}
mkdir -p "$OUT"
python -m blink.cli serve "$MODEL_DIR" --port "$PORT" $SERVE_ARGS > "$OUT/blink_serve.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server' EXIT
python -m bench.wait_healthy "$PORT" "$server" "$OUT/blink_serve.log" || exit 1
"$GUIDELLM" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=$REQUEST_FORMAT" \
  --profile "kind=constant,rate=$RATE" --constraint "kind=max_requests,count=$REQUESTS" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console --disable-progress 2>&1 | tee "$OUT/guidellm.log"
status=${PIPESTATUS[0]}
python - "$OUT/guidellm.json" <<'EOF' || status=1
import json, sys
benchmark, = json.load(open(sys.argv[1]))["benchmarks"]
totals = benchmark["metrics"]["request_totals"]
print(f"guidellm.json: {totals}")
assert totals["successful"] > 0 and totals["errored"] == 0, totals
EOF
exit "$status"
