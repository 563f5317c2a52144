#!/usr/bin/env bash
# Serving benchmark (part `serving` of bench/gpu_suite.sh): `blink serve` on a random-weights model of SHAPE against
# transformers' continuous batching, and vLLM where bench/peers/vllm_gpu.sh installed it (VLLM_PROMPTS > 0), on the
# same synthetic ShareGPT-like workload (`--ignore-eos`: every request generates its drawn output length), each
# isolated and with HOGS CPU+memory hogs; GPU energy per run.
# Writes $OUT/serving_{blink,vllm,hf}.json (+ .log), $OUT/serving_report.txt and PNGs in $OUT/serving_img/.
#
# Environment (defaults): SHAPE=qwen3-8b TOKENIZER=words (the shape's: bytes for structured outputs, blink.bench.shapes)
#   DEVICE=cuda PROMPTS=256 RATES=16,32,64,inf PEER_PROMPTS=128 PEER_RATES=inf
#   HOGS=4*nproc PEER_TIMEOUT=300 (s; the peer's JSON is rewritten after each run, so a cut-off run keeps the others)
#   PEER_PROMPTS=0 runs blink alone; PROMPTS=0 leaves blink out (vLLM or the peer alone). PORT=8321 BENCH_ARGS=""
#   (more `blink bench serve` options for both backends)
#   SERVE_ARGS="" (more `blink serve` options, e.g. "--agent-priority high"). SERVE_CPUS="" (the cores `blink serve`
#   may use, as `taskset -c SERVE_CPUS blink serve`; default: all). CLIENT_PRIORITY=normal (high: blink's
#   load generator at nice -10, so that the hogs contend with the server and not with the client that measures it;
#   the peer's client keeps normal priority, as its model runs in that process). The peer runs the first
#   PEER_PROMPTS requests of the same dataset (request i depends only on the seed and i). VLLM_PROMPTS=0 (vLLM off;
#   on, it serves the first VLLM_PROMPTS requests at RATES with the limits of vllm_gpu.sh, VLLM_ARGS passed on).
#   WARMUPS=0 (requests sent at once to blink and vLLM before each condition's sweep, not measured). Both cache
#   prefixes by default and every run of a sweep sends the same requests, so only the first run meets a cold cache:
#   WARMUPS=PROMPTS makes every run warm, SERVE_ARGS / VLLM_ARGS=--no-enable-prefix-caching every run cold.
#   RUNS="" (one run); or NAME:ARGS;NAME:ARGS;...: blink and vLLM each serve every named run in turn from one start,
#   its ARGS after the defaults (so "closed:--sweep inf --max-concurrency 64" overrides RATES), into
#   serving_<backend>_<NAME>.json and serving_report_<NAME>.txt; the peer runs the default run only.
# CPU dry run of the recipe: SHAPE=tiny-qwen3 DEVICE=cpu PROMPTS=8 RATES=4,inf PEER_PROMPTS=4 HOGS=2 \
#   BENCH_ARGS="--output-len 16" bash bench/serving_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
SHAPE=${SHAPE:-qwen3-8b} TOKENIZER=${TOKENIZER:-words} DEVICE=${DEVICE:-cuda} PROMPTS=${PROMPTS:-256} RATES=${RATES:-16,32,64,inf}
PEER_PROMPTS=${PEER_PROMPTS:-128} PEER_RATES=${PEER_RATES:-inf} HOGS=${HOGS:-$((4 * $(nproc)))}
PEER_TIMEOUT=${PEER_TIMEOUT:-300} PORT=${PORT:-8321} BENCH_ARGS=${BENCH_ARGS:-} SERVE_ARGS=${SERVE_ARGS:-}
SERVE_CPUS=${SERVE_CPUS:-}
CLIENT_PRIORITY=${CLIENT_PRIORITY:-normal} VLLM_PROMPTS=${VLLM_PROMPTS:-0} WARMUPS=${WARMUPS:-0}
mkdir -p "$OUT"
# The GPU machine has no network: if its image lacks nvidia-ml-py (energy) or matplotlib (plots), install them from
# wheels/ (downloaded on a networked machine, see docs/benchmarks/suite.md); without them energy is reported unavailable.
python -c "import pynvml, matplotlib" 2>/dev/null \
  || python -m pip install -q --no-index --find-links wheels nvidia-ml-py matplotlib \
  || echo "serving: nvidia-ml-py / matplotlib missing and no wheels/ to install them from"
model=$(mktemp -d)/$SHAPE
python -m blink.bench.shapes "$model" --shape "$SHAPE" --tokenizer "$TOKENIZER" || exit 1
# blink's agent compiles structured outputs with outlines-core, which the GPU image lacks: from wheels/ too.
python -c "import outlines_core" 2>/dev/null || python -m pip install -q --no-index --find-links wheels outlines-core \
  || echo "serving: outlines-core missing and no wheels/ to install it from (structured outputs get 400)"
status=0
IFS=';' read -ra runs <<< "${RUNS:-:}"

# `bench_runs LABEL URL PROMPTS PID`: `blink bench serve` for every run of RUNS against the server at URL, its CPU time
# that of process PID and its descendants (vLLM's /metrics counts its API server alone, not its engine core).
bench_runs() {
  local label=$1 url=$2 prompts=$3 pid=$4 run suffix
  for run in "${runs[@]}"; do
    suffix=${run%%:*}
    suffix=${suffix:+_$suffix}
    python -m blink.cli bench serve --label "$label" --base-url "$url" --tokenizer "$model" --num-prompts "$prompts" \
      --sweep "$RATES" --ignore-eos --interference "$HOGS" --num-warmups "$WARMUPS" $BENCH_ARGS ${run#*:} \
      --server-pid "$pid" \
      --client-priority "$CLIENT_PRIORITY" --result-json "$OUT/serving_$label$suffix.json" 2>&1 \
      | tee "$OUT/serving_$label$suffix.log" || status=1
  done
}

# blink: engine + agent over a shared-memory ring; prompts <= 1024 and prompt + output <= 2048 tokens (datasets.py).
if [ "$PROMPTS" -gt 0 ]; then
  ${SERVE_CPUS:+taskset -c "$SERVE_CPUS"} python -m blink.cli serve "$model" --load-format dummy --device "$DEVICE" \
    --port "$PORT" --slots 512 --max-prompt-tokens 1024 --max-output-tokens 2048 $SERVE_ARGS \
    > "$OUT/serving_server.log" 2>&1 &
  server=$!
  python -m bench.wait_healthy "$PORT" "$server" "$OUT/serving_server.log" || status=1
  [ $status -eq 0 ] && bench_runs blink "http://127.0.0.1:$PORT" "$PROMPTS" "$server"
  kill -INT $server; wait $server
fi

# vLLM, on the GPU once blink has released it, with blink's limits (vllm_gpu.sh: max model length 4096, blink's cap,
# and 256 sequences, blink's max_num_seqs).
if [ "$VLLM_PROMPTS" -gt 0 ]; then
  if PORT=$((PORT + 1)) LOG="$OUT/serving_vllm_server.log" \
      bash bench/peers/vllm_gpu.sh serve "$model"; then
    bench_runs vllm "http://127.0.0.1:$((PORT + 1))" "$VLLM_PROMPTS" "$(bash bench/peers/vllm_gpu.sh pid)"
  else
    status=1
  fi
  bash bench/peers/vllm_gpu.sh stop
fi

# The peer, on the GPU once blink and vLLM have released it (PEER_PROMPTS=0: no peer).
if [ "$PEER_PROMPTS" -gt 0 ]; then
  timeout "$PEER_TIMEOUT" python -m blink.cli bench serve --backend hf --label hf --model "$model" \
    --load-format dummy --device "$DEVICE" --num-prompts "$PEER_PROMPTS" --sweep "$PEER_RATES" --ignore-eos \
    --interference "$HOGS" $BENCH_ARGS --result-json "$OUT/serving_hf.json" 2>&1 | tee "$OUT/serving_hf.log" \
    || status=1
fi

for run in "${runs[@]}"; do
  suffix=${run%%:*}
  suffix=${suffix:+_$suffix}
  results=$(ls "$OUT/serving_blink$suffix.json" "$OUT/serving_vllm$suffix.json" 2>/dev/null)
  [ -z "$suffix" ] && results="$results $(ls "$OUT/serving_hf.json" 2>/dev/null)"
  python -m blink.cli bench report $results --plot-dir "$OUT/serving_img$suffix" 2>&1 \
    | tee "$OUT/serving_report$suffix.txt" || status=1
done
exit $status
