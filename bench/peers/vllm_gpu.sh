#!/usr/bin/env bash
# vLLM on the GPU machine, from the chunks bench/peers/fetch_wheels.py made where the registry is reachable (the GPU
# machine has none). The staged files live under PEERS, outside the tree, so they outlast one run:
#   bash bench/peers/vllm_gpu.sh stage DIR       copy the chunks found in DIR (and SHA256SUMS) into $PEERS/chunks,
#                                                each checked against SHA256SUMS; a run may bring any subset
#   bash bench/peers/vllm_gpu.sh install         once every chunk is staged: join, check the tar and every wheel
#                                                against SHA256SUMS and the manifest, pip install --no-index --no-deps
#                                                --target $PEERS/site (the image's torch, triton, numba stay in use)
#   bash bench/peers/vllm_gpu.sh serve MODEL     start vLLM's OpenAI server on MODEL (a shape directory) with blink's
#                                                limits, in the background; wait until /health answers (its pid in
#                                                $PEERS/vllm_server.pid)
#   bash bench/peers/vllm_gpu.sh stop            stop that server (SIGINT, then SIGKILL after 30 s)
#   bash bench/peers/vllm_gpu.sh pid             print that server's pid (its engine core and API servers are its
#                                                descendants: `blink bench serve --server-pid` meters their CPU)
# Environment (defaults): PEERS=$HOME/blink-peers PORT=8400 MAX_MODEL_LEN=4096 MAX_NUM_SEQS=256
#   GPU_MEMORY_UTILIZATION=0.9 API_SERVERS=4 (vLLM's front-end processes, --api-server-count: its best setting on
#   the H200, issue 43; 1 for its default) VLLM_ARGS="" (more `vllm serve` options, e.g. --no-enable-prefix-caching) and LOG
#   ($PEERS/vllm_server.log). The shape directories' word-level tokenizer makes vLLM see text prompts as empty:
#   `blink bench serve` sends token ids, which vLLM takes as they are.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-$HOME/blink-peers} PORT=${PORT:-8400} MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096} API_SERVERS=${API_SERVERS:-4}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256} GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9} VLLM_ARGS=${VLLM_ARGS:-}
LOG=${LOG:-$PEERS/vllm_server.log}
MANIFEST=bench/peers/vllm-0.26.0-wheels.txt
mkdir -p "$PEERS/chunks"

stage() {
  local from=${1:?usage: vllm_gpu.sh stage DIR}
  cp "$from/SHA256SUMS" "$PEERS/chunks/"
  for chunk in "$from"/wheels.tar.[0-9]*; do
    [ -e "$chunk" ] || continue
    cp "$chunk" "$PEERS/chunks/"
  done
  (cd "$PEERS/chunks" && grep -E 'wheels\.tar\.[0-9]+$' SHA256SUMS | while read -r sum name; do
    if [ -e "$name" ]; then echo "$sum  $name" | sha256sum -c --quiet - && echo "staged $name"; fi
  done)
  missing=$(cd "$PEERS/chunks" && grep -E 'wheels\.tar\.[0-9]+$' SHA256SUMS | awk '{print $2}' \
    | while read -r name; do [ -e "$name" ] || echo "$name"; done)
  echo "missing: ${missing:-none}"
}

install() {
  cd "$PEERS/chunks"
  grep -E 'wheels\.tar\.[0-9]+$' SHA256SUMS | sha256sum -c --quiet -   # every chunk there and intact
  cat $(grep -E 'wheels\.tar\.[0-9]+$' SHA256SUMS | awk '{print $2}' | sort) > ../wheels.tar
  cd ..
  grep -E ' wheels\.tar$' chunks/SHA256SUMS | sha256sum -c --quiet -
  rm -rf wheels && mkdir wheels && tar -xf wheels.tar -C wheels && rm wheels.tar
  grep -v '^#' wheels/"$(basename "$MANIFEST")" | awk 'NF == 3 {print $1 "  " $2}' | (cd wheels && sha256sum -c --quiet -)
  python -m pip install --no-index --no-deps --target site wheels/*.whl > install.log 2>&1 \
    || { tail -20 install.log; exit 1; }
  PYTHONPATH=$PEERS/site python -c "import vllm; print('vllm', vllm.__version__, 'installed in $PEERS/site')"
}

serve() {
  local model=${1:?usage: vllm_gpu.sh serve MODEL_DIR}
  # VLLM_USE_FLASHINFER_SAMPLER=0: FlashInfer's sampler would compile its kernels with nvcc at first use.
  # `vllm serve` (its CLI module: --target installs no console script), which honours --api-server-count; the
  # api_server module ignores it and runs one front end, vLLM's CPU bottleneck on small models.
  PYTHONPATH=$PEERS/site VLLM_USE_FLASHINFER_SAMPLER=0 nohup python -m vllm.entrypoints.cli.main serve "$model" \
    --api-server-count "$API_SERVERS" --load-format dummy --port "$PORT" --max-model-len "$MAX_MODEL_LEN" \
    --max-num-seqs "$MAX_NUM_SEQS" --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" $VLLM_ARGS > "$LOG" 2>&1 &
  local pid=$!
  echo "$pid" > "$PEERS/vllm_server.pid"
  PYTHONPATH=src python -m bench.wait_healthy "$PORT" "$pid" "$LOG"
  echo "vllm serving $model on port $PORT, pid $pid"
}

stop() {
  local pid
  pid=$(cat "$PEERS/vllm_server.pid" 2>/dev/null) || return 0
  kill -INT "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PEERS/vllm_server.pid"
}

case "${1:-}" in
  stage) stage "${2:-}" ;;
  install) install ;;
  serve) serve "${2:-}" ;;
  stop) stop ;;
  pid) cat "$PEERS/vllm_server.pid" ;;
  *) echo "usage: bash bench/peers/vllm_gpu.sh stage DIR | install | serve MODEL_DIR | stop | pid" >&2; exit 2 ;;
esac
