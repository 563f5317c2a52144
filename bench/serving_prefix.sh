#!/usr/bin/env bash
# The prefix cache's serving benchmark (part `serving-prefix` of bench/gpu_suite.sh): `blink serve` on a random-
# weights model of SHAPE, with --enable-prefix-caching and then with --no-enable-prefix-caching, each serving two
# shared-prefix workloads of `blink bench serve --dataset prefix` (`--ignore-eos`, every output OUTPUT_LEN tokens):
#   shared:     PROMPTS requests behind one PREFIX_LEN-token system prompt, CONCURRENCY streams at a time, sent twice
#               (the second run finds every prompt cached: "the same prompts sent a second time");
#   multi-turn: PROMPTS requests in conversations of TURNS turns, each turn resending the ones before it.
# Each run's record holds the server's counters over it (`server`: prefill tokens computed, prefix-cache hits).
# Writes $OUT/prefix_{on,off}_{shared,turns}.json (+ .log), the servers' logs and $OUT/prefix_report.txt.
#
# Environment (defaults): SHAPE=qwen3-8b DEVICE=cuda PROMPTS=128 CONCURRENCY=64 PREFIX_LEN=1536 TURNS=4
#   OUTPUT_LEN=128 PORT=8322 SERVE_ARGS="" BENCH_ARGS="" (more `blink serve` / `blink bench serve` options)
# CPU dry run: SHAPE=tiny-qwen3 DEVICE=cpu PROMPTS=8 CONCURRENCY=4 PREFIX_LEN=64 TURNS=2 OUTPUT_LEN=8 \
#   bash bench/serving_prefix.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
SHAPE=${SHAPE:-qwen3-8b} DEVICE=${DEVICE:-cuda} PROMPTS=${PROMPTS:-128} CONCURRENCY=${CONCURRENCY:-64}
PREFIX_LEN=${PREFIX_LEN:-1536} TURNS=${TURNS:-4} OUTPUT_LEN=${OUTPUT_LEN:-128} PORT=${PORT:-8322}
SERVE_ARGS=${SERVE_ARGS:-} BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
model=$(mktemp -d)/$SHAPE
python -m blink.bench.shapes "$model" --shape "$SHAPE" || exit 1
status=0
for caching in on off; do
  flag=--enable-prefix-caching
  [ "$caching" = off ] && flag=--no-enable-prefix-caching
  # Prompts: the system prompt, then at most TURNS exchanges of up to 256 + 256 tokens (datasets.MAX_TURN_LEN).
  python -m blink.cli serve "$model" --load-format dummy --device "$DEVICE" --port "$PORT" --slots 512 \
    --max-model-len 4096 --max-prompt-tokens 3584 --max-output-tokens 512 "$flag" $SERVE_ARGS \
    > "$OUT/prefix_${caching}_server.log" 2>&1 &
  server=$!
  if python -m bench.wait_healthy "$PORT" "$server" "$OUT/prefix_${caching}_server.log"; then
    for workload in shared turns; do
      if [ "$workload" = shared ]; then args=(--turns 1 --sweep inf,inf); else args=(--turns "$TURNS" --sweep inf); fi
      python -m blink.cli bench serve --label "prefix-$caching" --base-url "http://127.0.0.1:$PORT" \
        --tokenizer "$model" --dataset prefix --prefix-len "$PREFIX_LEN" --num-prompts "$PROMPTS" \
        --max-concurrency "$CONCURRENCY" --output-len "$OUTPUT_LEN" --ignore-eos "${args[@]}" $BENCH_ARGS \
        --result-json "$OUT/prefix_${caching}_${workload}.json" 2>&1 | tee "$OUT/prefix_${caching}_${workload}.log" \
        || status=1
    done
  else
    status=1
  fi
  kill -INT $server; wait $server
done

python - "$OUT" <<'PY' 2>&1 | tee "$OUT/prefix_report.txt" || status=1
import json, os, sys
out = sys.argv[1]
print(f"{'run':<24} {'TTFT P50 ms':>12} {'TTFT P99 ms':>12} {'out tok/s':>10} {'total tok/s':>12} "
      f"{'prefill tokens':>15} {'cache hits':>11}")
for caching in ("on", "off"):
    for workload in ("shared", "turns"):
        path = os.path.join(out, f"prefix_{caching}_{workload}.json")
        if not os.path.exists(path):
            continue
        for k, run in enumerate(json.load(open(path))["runs"]):
            server = run["server"] or {}
            print(f"{caching + ' ' + workload + ' #' + str(k + 1):<24} {run['median_ttft_ms']:>12.1f} "
                  f"{run['p99_ttft_ms']:>12.1f} {run['output_throughput']:>10.1f} "
                  f"{run['total_token_throughput']:>12.1f} {server.get('blink_prefill_tokens_total', 0):>15.0f} "
                  f"{server.get('blink_prefix_cache_hits_total', 0):>11.0f}")
PY
exit $status
