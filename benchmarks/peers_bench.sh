#!/usr/bin/env bash
# JustAPI, llama.cpp's server and vLLM's CPU build, all serving SmolLM2-135M on loopback, measured by one client,
# `justapi bench`, in one run: S1 (single stream), W1 (mixed lengths), W2 (shared prefix) and a W1-like rate sweep.
#   benchmarks/peers_bench.sh [sweep]
# The three servers are started together (idle, each uses ~0% CPU) and measured one after another by each
# `justapi bench serve` call. Needs the peers installed with the recipes in ../shared/peers (README there).
# Results: bench_results/peers_{S1,W1,W2}.json, bench_results/sweep.{json,png}, bench_results/peers_bench.txt
# Before/after a change, in the same run: JUSTAPI_BEFORE=DIR serves the checkout in DIR (another revision, e.g.
# `git worktree add ../before REV`) as "justapi-before" on the next port, with this venv's Python and
# JUSTAPI_BEFORE_ARGS (e.g. --scheduled for revisions whose default was static batching); where that revision
# compiles its kernels on first use, they go to DIR/.torch_extensions.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STEER=${STEER:-$ROOT/../shared/peers}
source "$STEER/env.sh"
PORT_JUSTAPI=${PORT_JUSTAPI:-8010}
OUT=$ROOT/bench_results
mkdir -p "$OUT" "$PEERS/run" "$PEERS/logs"
# llama.cpp's ggml AMX kernels crashed on the AMX machines (general protection fault); --no-repack avoids them.
# Without AMX (AVX2 or AVX-512 only) llama-server keeps its default repacking.
if grep -q -m1 amx_tile /proc/cpuinfo; then export LLAMA_EXTRA=${LLAMA_EXTRA---no-repack}; fi
J=$ROOT/.venv/bin/justapi
up() { curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/v1/models" 2>/dev/null | grep -q 200; }

up "$PORT_JUSTAPI" || {
  setsid "$J" serve --port "$PORT_JUSTAPI" --served-model-name "$SERVED_NAME" \
    > "$PEERS/logs/justapi.log" 2>&1 < /dev/null &
  echo $! > "$PEERS/run/justapi.pid"
  "$STEER/wait_ready.sh" "$PORT_JUSTAPI" 300 "$PEERS/run/justapi.pid" "$PEERS/logs/justapi.log"; }
URLS=(--base-url "http://127.0.0.1:$PORT_JUSTAPI" --name justapi)
if [ -n "${JUSTAPI_BEFORE:-}" ]; then
  PORT_BEFORE=$((PORT_JUSTAPI + 1))
  up "$PORT_BEFORE" || {
    # shellcheck disable=SC2086 # the extra flags are words
    PYTHONPATH="$JUSTAPI_BEFORE" TORCH_EXTENSIONS_DIR="$JUSTAPI_BEFORE/.torch_extensions" setsid \
      "$ROOT/.venv/bin/python" -m justapi.cli serve ${JUSTAPI_BEFORE_ARGS:-} --port "$PORT_BEFORE" \
      --served-model-name "$SERVED_NAME" > "$PEERS/logs/justapi_before.log" 2>&1 < /dev/null &
    echo $! > "$PEERS/run/justapi_before.pid"
    "$STEER/wait_ready.sh" "$PORT_BEFORE" 900 "$PEERS/run/justapi_before.pid" "$PEERS/logs/justapi_before.log"; }
  URLS+=(--base-url "http://127.0.0.1:$PORT_BEFORE" --name justapi-before)
fi
up "$PORT_LLAMA_SERVER" || "$STEER/start_llama_server.sh"
up "$PORT_VLLM" || "$STEER/start_vllm.sh"

URLS+=(--base-url "http://127.0.0.1:$PORT_LLAMA_SERVER" --name llama.cpp
      --base-url "http://127.0.0.1:$PORT_VLLM" --name vllm-cpu-fp32)
LOG=$OUT/peers_bench.txt
{
  echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "## S1: 4 requests one at a time, 128 prompt + 128 output tokens (decode tok/s = 1000 / TPOT p50)"
  timeout 900 "$J" bench serve "${URLS[@]}" --workload random --num-requests 4 --max-concurrency 1 \
    --input-len 128 --output-len 128 --json "$OUT/peers_S1.json"
  echo "## W1: 128 requests at once, <= 32 in flight, prompts 64-512, outputs 16-256 tokens, ignore EOS"
  timeout 1800 "$J" bench serve "${URLS[@]}" --workload random --num-requests 128 --max-concurrency 32 \
    --input-len 64:512 --output-len 16:256 --json "$OUT/peers_W1.json"
  echo "## W2: 64 requests at once, <= 32 in flight: one 400-token prefix + a unique 32-token suffix, 64 output tokens"
  timeout 900 "$J" bench serve "${URLS[@]}" --workload shared-prefix --num-prefixes 1 --suffixes-per-prefix 64 \
    --prefix-len 400 --input-len 32 --output-len 64 --max-concurrency 32 --json "$OUT/peers_W2.json"
  if [ "${1:-}" = sweep ]; then
    echo "## sweep: 48 requests (prompts 64-512, outputs 16-128) at 1, 2, 4 req/s (Poisson) and all at once"
    timeout 2400 "$J" bench sweep "${URLS[@]}" --workload random --num-requests 48 --input-len 64:512 \
      --output-len 16:128 --rates 1,2,4,inf --max-concurrency 32 --out "$OUT/sweep"
  fi
} 2>&1 | tee "$LOG"
if [ "${KEEP_SERVERS:-0}" != 1 ]; then
  "$STEER/stop_server.sh" justapi; "$STEER/stop_server.sh" llama_server
  [ -n "${JUSTAPI_BEFORE:-}" ] && "$STEER/stop_server.sh" justapi_before; "$STEER/stop_server.sh" vllm
fi
