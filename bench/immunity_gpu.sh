#!/usr/bin/env bash
# Agent immunity: `blink serve` at its default options and the transformers peer on the Qwen3-8B shape, closed loop
# (64 concurrent streams), isolated and with HOGS hogs, in the layouts a shared host offers; one layout per run, so
# each fits in 10 minutes:
#   bash bench/immunity_gpu.sh shared        hogs on every core, the client at normal priority
#   bash bench/immunity_gpu.sh client-high   the same with the client at nice -10 (a client on another host); the
#                                            peer's process (its model runs in the client) at nice -10 too;
#                                            CLIENT_PRIORITY=deadline raises both further (--client-priority)
#   bash bench/immunity_gpu.sh reserved      hogs kept off RESERVED, where the agent (--cpus) and the client run (a
#                                            DPU or reserved-cpuset stand-in); the peer runs there too
#   bash bench/immunity_gpu.sh client-apart  hogs kept off RESERVED, where the client runs at nice -10 (a client on
#                                            another host, which the hogs cannot slow); `blink serve` at its defaults on
#                                            the other cores (taskset), among the hogs; the peer beside its client
#   bash bench/immunity_gpu.sh report        the layouts measured so far in this OUT, side by side
# Each layout is bench/serving_gpu.sh (RATES=inf, --max-concurrency 64, --ignore-eos, WARMUPS=PROMPTS: every request
# once before each condition's run, so that both meet the prefix cache warm and their connections open; without them
# the isolated run prefilled every prompt and the colocated one found 95% of them cached) into $OUT/<layout>/; after
# every run $OUT/immunity.tgz bundles all of $OUT (one file holds them all) and
# $OUT/immunity_report.txt compares the layouts (`blink bench report`: P50/P99 TTFT, P99 TPOT, P99 worst gap, the
# server's CPU per 1,000 tokens and the colocated / isolated ratios).
# Environment (defaults): OUT=out SHAPE=qwen3-8b PROMPTS=256 PEER_PROMPTS=32 (0: blink only) HOGS=4*nproc
#   HOG_KIND=mixed (or memory / cpu: `blink bench serve --hog-kind`, to tell memory bandwidth from CPU time)
#   RESERVED=the last two cores SERVE_ARGS="" (more `blink serve` options) BLINK_COMMIT (the tree's commit, recorded)
#   REPEATS=1 (more: the layout that many times, into $OUT/<layout>-1, -2, ..., each its own rows in the report: one
#   run's P99 of a few hundred requests is about its third-worst request and moves between runs).
# CPU dry run of the recipe: SHAPE=tiny-qwen3 DEVICE=cpu PROMPTS=16 PEER_PROMPTS=4 HOGS=4 bash bench/immunity_gpu.sh
#   shared
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out} PROMPTS=${PROMPTS:-256} PEER_PROMPTS=${PEER_PROMPTS:-32} SERVE_ARGS=${SERVE_ARGS:-}
REPEATS=${REPEATS:-1} CLIENT=${CLIENT_PRIORITY:-high}
RESERVED=${RESERVED:-$(python -c "import os; c = sorted(os.sched_getaffinity(0)); print(','.join(map(str, c[-2:])))")}
OTHERS=$(python -c "import os, sys; kept = set(map(int, sys.argv[1].split(',')))
print(','.join(str(c) for c in sorted(os.sched_getaffinity(0)) if c not in kept))" "$RESERVED")
layout=${1:?usage: bash bench/immunity_gpu.sh shared|client-high|reserved|client-apart|report}
BASE="--max-concurrency 64 --hog-kind ${HOG_KIND:-mixed}"
export WARMUPS=$PROMPTS
mkdir -p "$OUT"
echo "tree: ${BLINK_COMMIT:-unknown (set BLINK_COMMIT)}; layout $layout; hogs ${HOG_KIND:-mixed}; $(nproc) cores;" \
  "reserved $RESERVED" \
  >> "$OUT/immunity_runs.txt"
# The host's topology: which cores are hyperthread siblings (a hog on the agent's sibling shares its core's caches).
lscpu -e > "$OUT/lscpu.txt" 2>&1 || true
# Which cgroup hierarchy the host gives (v1 or v2, and this process's place in it): what a reserved-core layout can
# ask of it (a cgroup v2 cpuset partition needs a writable v2 hierarchy).
(cat /proc/self/cgroup; grep cgroup /proc/mounts) > "$OUT/cgroup.txt" 2>&1 || true
status=0
# `layout_run DIR`: one run of the layout into $OUT/DIR.
layout_run() {
  local dir=$OUT/$1
  case "$layout" in
    shared)
      OUT="$dir" RATES=inf PROMPTS=$PROMPTS PEER_PROMPTS=$PEER_PROMPTS SERVE_ARGS="$SERVE_ARGS" \
        BENCH_ARGS="$BASE" bash bench/serving_gpu.sh ;;
    client-high)
      # serving_gpu.sh gives CLIENT_PRIORITY to blink's client only; BENCH_ARGS carries it to the peer's run too.
      OUT="$dir" RATES=inf PROMPTS=$PROMPTS PEER_PROMPTS=$PEER_PROMPTS SERVE_ARGS="$SERVE_ARGS" \
        CLIENT_PRIORITY=$CLIENT BENCH_ARGS="$BASE --client-priority $CLIENT" bash bench/serving_gpu.sh ;;
    reserved)
      OUT="$dir" RATES=inf PROMPTS=$PROMPTS PEER_PROMPTS=$PEER_PROMPTS SERVE_ARGS="--cpus $RESERVED $SERVE_ARGS" \
        BENCH_ARGS="$BASE --reserve-cpus $RESERVED" bash bench/serving_gpu.sh ;;
    client-apart)
      OUT="$dir" RATES=inf PROMPTS=$PROMPTS PEER_PROMPTS=$PEER_PROMPTS SERVE_ARGS="$SERVE_ARGS" SERVE_CPUS="$OTHERS" \
        CLIENT_PRIORITY=high BENCH_ARGS="$BASE --reserve-cpus $RESERVED --client-priority high" \
        bash bench/serving_gpu.sh ;;
  esac
}
case "$layout" in
  shared|client-high|reserved|client-apart)
    for i in $(seq "$REPEATS"); do
      if [ "$REPEATS" -gt 1 ]; then layout_run "$layout-$i" || status=1; else layout_run "$layout" || status=1; fi
    done ;;
  report) ;;
  *) echo "unknown layout: $layout (shared | client-high | reserved | client-apart | report)"; exit 2 ;;
esac
# The labels say the layout: blink-shared, hf-reserved, ...
python - "$OUT" <<'PY' || status=1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*/serving_*.json")):
    result = json.loads(path.read_text())
    for run in result["runs"]:
        run["label"] = f"{run['label'].split('-')[0]}-{path.parent.name}"
    (out / f"{path.stem}_{path.parent.name}.json").write_text(json.dumps(result, indent=1))
PY
results=$(ls "$OUT"/serving_blink_*.json "$OUT"/serving_hf_*.json 2>/dev/null)
[ -n "$results" ] && python -m blink.cli bench report $results > "$OUT/immunity_report.txt" 2>&1
cat "$OUT/immunity_report.txt" 2>/dev/null
bundle=$(mktemp)
tar -czf "$bundle" --exclude=immunity.tgz -C "$OUT" . && mv "$bundle" "$OUT/immunity.tgz"
exit $status
