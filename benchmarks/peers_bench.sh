#!/usr/bin/env bash
# JustAPI, llama.cpp's server and vLLM's CPU build, all serving SmolLM2-135M on loopback, measured by one client,
# `justapi bench`, in one run: S1 (single stream), W1 (mixed lengths), W2 (shared prefix), W3 (Poisson arrivals, longer
# prompts) and a W1-like rate sweep.
#   benchmarks/peers_bench.sh [sweep]
# Another model: BENCH_GGUF=PATH BENCH_NAME=NAME [BENCH_HF_DIR=DIR] benchmarks/peers_bench.sh: JustAPI and llama.cpp
# serve the GGUF, vLLM the dequantized HF copy in DIR (../shared/peers/setup_gemma3.sh makes Gemma 3's), or no vLLM
# without one. The peers' start scripts pin SmolLM2 (env.sh), so this script starts them itself with their flags.
# The three servers are started together (idle, each uses ~0% CPU) and measured one after another by each
# `justapi bench serve` call. Needs the peers installed with the recipes in ../shared/peers (README there).
# LLAMA_SERVER=PATH serves llama.cpp with another build (benchmarks/as_avx2.sh: one built for a Zen 3).
# Results: bench_results/peers_{S1,W1,W2,W3}.json, bench_results/bounds.{json,txt} (each workload's bound on this
# machine, benchmarks/bounds.py), bench_results/sweep.{json,png}, bench_results/peers_bench.txt
# Before/after a change, in the same run: JUSTAPI_BEFORE=DIR serves the checkout in DIR (another revision, e.g.
# `git worktree add ../before REV`) as "justapi-before" on the next port, with this venv's Python and
# JUSTAPI_BEFORE_ARGS (e.g. --scheduled for revisions whose default was static batching); where that revision
# compiles its kernels on first use, they go to DIR/.torch_extensions. S1, W1, W2 and W3 then run a second time with the
# two JustAPI servers in the other order, and `justapi bench compare` prints after / before from both orders.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STEER=${STEER:-$ROOT/../shared/peers}
source "$STEER/env.sh"
if [ -n "${BENCH_GGUF:-}" ]; then
  GGUF=$BENCH_GGUF; SERVED_NAME=${BENCH_NAME:?BENCH_NAME names the served model}; HF_DIR=${BENCH_HF_DIR:-}
fi
PORT_JUSTAPI=${PORT_JUSTAPI:-8010}
# llama-server splits its context evenly between its slots: W3's longest request is 1024 + 256 tokens
export LLAMA_CTX_PER_SLOT=${LLAMA_CTX_PER_SLOT:-1536}
OUT=$ROOT/bench_results${BENCH_GGUF:+/$SERVED_NAME}  # another model: its own folder
mkdir -p "$OUT" "$PEERS/run" "$PEERS/logs"
# llama.cpp's ggml AMX kernels crashed on the AMX machines (general protection fault); --no-repack avoids them.
# Without AMX (AVX2 or AVX-512 only) llama-server keeps its default repacking.
if grep -q -m1 amx_tile /proc/cpuinfo; then export LLAMA_EXTRA=${LLAMA_EXTRA---no-repack}; fi
J=$ROOT/.venv/bin/justapi
workload() { sed -n "s/^$1 //p" "$ROOT/benchmarks/workloads.txt"; }  # S1, W1, W2, W3: one place for both scripts
up() { curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/v1/models" 2>/dev/null | grep -q 200; }

# the machine's read bandwidth and matmul rates, measured before any server starts, and each workload's bound
"$ROOT/.venv/bin/python" "$ROOT/benchmarks/bounds.py" --model "$GGUF" --json "$OUT/bounds.json" > "$OUT/bounds.txt"
# two JustAPI servers (JUSTAPI_BEFORE) hold two default KV pools, a quarter of the memory each, touched at start:
# beside llama.cpp and vLLM's 4 GB of KV that ran a 24 GiB machine out of memory (docs/benchmarks.md), so each then
# gets 3 GB (W1-W3 use under 1 GB of it); JUSTAPI_KV_MEMORY sets it either way
KV_MEMORY=${JUSTAPI_KV_MEMORY:-${JUSTAPI_BEFORE:+3G}}
up "$PORT_JUSTAPI" || {
  # shellcheck disable=SC2086 # the optional flag is words
  setsid "$J" serve --model "$GGUF" --port "$PORT_JUSTAPI" --served-model-name "$SERVED_NAME" \
    ${KV_MEMORY:+--kv-memory $KV_MEMORY} \
    > "$PEERS/logs/justapi.log" 2>&1 < /dev/null &
  echo $! > "$PEERS/run/justapi.pid"
  "$STEER/wait_ready.sh" "$PORT_JUSTAPI" 300 "$PEERS/run/justapi.pid" "$PEERS/logs/justapi.log"; }
URLS=(--base-url "http://127.0.0.1:$PORT_JUSTAPI" --name justapi)
if [ -n "${JUSTAPI_BEFORE:-}" ]; then
  PORT_BEFORE=$((PORT_JUSTAPI + 1))
  up "$PORT_BEFORE" || {
    # shellcheck disable=SC2086 # the extra flags are words
    # run from DIR: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    (cd "$JUSTAPI_BEFORE" && PYTHONPATH="$JUSTAPI_BEFORE" TORCH_EXTENSIONS_DIR="$JUSTAPI_BEFORE/.torch_extensions" \
      exec setsid "$ROOT/.venv/bin/python" -m justapi.cli serve ${JUSTAPI_BEFORE_ARGS:-} --model "$GGUF" \
      --kv-memory "$KV_MEMORY" \
      --port "$PORT_BEFORE" --served-model-name "$SERVED_NAME" > "$PEERS/logs/justapi_before.log" 2>&1 < /dev/null) &
    echo $! > "$PEERS/run/justapi_before.pid"
    "$STEER/wait_ready.sh" "$PORT_BEFORE" 900 "$PEERS/run/justapi_before.pid" "$PEERS/logs/justapi_before.log"; }
  URLS+=(--base-url "http://127.0.0.1:$PORT_BEFORE" --name justapi-before)
fi
start_llama_server() {  # start_llama_server.sh's command line, on $GGUF, with $LLAMA_SERVER (another build) if set
  if [ -z "${BENCH_GGUF:-}" ] && [ -z "${LLAMA_SERVER:-}" ]; then "$STEER/start_llama_server.sh"; return; fi
  local np=${LLAMA_NP:-32} t=${LLAMA_THREADS:-$(nproc)}
  # shellcheck disable=SC2086 # the extra flags are words
  setsid "${LLAMA_SERVER:-$PEERS/build/llama.cpp/bin/llama-server}" -m "$GGUF" -a "$SERVED_NAME" --host 127.0.0.1 \
    --port "$PORT_LLAMA_SERVER" -np "$np" -cb -c $(( np * ${LLAMA_CTX_PER_SLOT:-1024} )) -t "$t" -tb "$t" \
    -b 2048 -ub 512 --metrics ${LLAMA_EXTRA:-} > "$PEERS/logs/llama_server.log" 2>&1 < /dev/null &
  echo $! > "$PEERS/run/llama_server.pid"
  "$STEER/wait_ready.sh" "$PORT_LLAMA_SERVER" 300 "$PEERS/run/llama_server.pid" "$PEERS/logs/llama_server.log"
}
start_vllm() {  # start_vllm.sh's command line and environment, on $HF_DIR
  if [ -z "${BENCH_GGUF:-}" ]; then "$STEER/start_vllm.sh"; return; fi
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_NUM_OF_RESERVED_CPU=0
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}
  LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$PEERS/venvs/vllm/lib/libiomp5.so" setsid \
    "$PEERS/venvs/vllm/bin/python" "$STEER/vllm_cli.py" serve "$HF_DIR" --served-model-name "$SERVED_NAME" \
    --host 127.0.0.1 --port "$PORT_VLLM" --dtype "${VLLM_DTYPE:-float32}" --max-model-len 2048 \
    --max-num-seqs "${VLLM_MAX_NUM_SEQS:-32}" --enable-prefix-caching > "$PEERS/logs/vllm_server.log" 2>&1 < /dev/null &
  echo $! > "$PEERS/run/vllm.pid"
  "$STEER/wait_ready.sh" "$PORT_VLLM" 900 "$PEERS/run/vllm.pid" "$PEERS/logs/vllm_server.log"
}
up "$PORT_LLAMA_SERVER" || start_llama_server
URLS+=(--base-url "http://127.0.0.1:$PORT_LLAMA_SERVER" --name llama.cpp)
if [ -z "${BENCH_GGUF:-}" ] || [ -n "$HF_DIR" ]; then
  up "$PORT_VLLM" || start_vllm
  URLS+=(--base-url "http://127.0.0.1:$PORT_VLLM" --name vllm-cpu-fp32)
fi
LOG=$OUT/peers_bench.txt
{
  echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)," \
    "$(basename "$GGUF")${AS_CPU:+, as on $AS_CPU}"
  echo "## S1: 4 requests one at a time, 128 prompt + 128 output tokens (decode tok/s = 1000 / TPOT p50)"
  # shellcheck disable=SC2046 # the workload's arguments are words
  timeout 900 "$J" bench serve "${URLS[@]}" $(workload S1) --json "$OUT/peers_S1.json"
  echo "## W1: 128 requests at once, <= 32 in flight, prompts 64-512, outputs 16-256 tokens, ignore EOS"
  # shellcheck disable=SC2046
  timeout 1800 "$J" bench serve "${URLS[@]}" $(workload W1) --json "$OUT/peers_W1.json"
  echo "## W2: 64 requests at once, <= 32 in flight: one 400-token prefix + a unique 32-token suffix, 64 output tokens"
  # shellcheck disable=SC2046
  timeout 900 "$J" bench serve "${URLS[@]}" $(workload W2) --json "$OUT/peers_W2.json"
  echo "## W3: 96 requests, Poisson arrivals at 1.2 req/s, <= 24 in flight, prompts 128-1024, outputs 16-256 tokens"
  # shellcheck disable=SC2046
  timeout 1800 "$J" bench serve "${URLS[@]}" $(workload W3) --json "$OUT/peers_W3.json"
  echo "## each figure as a share of what this machine allows it (benchmarks/bounds.py), beside the ratio to the best peer"
  cat "$OUT/bounds.txt"
  "$ROOT/.venv/bin/python" "$ROOT/benchmarks/bounds.py" report "$OUT/bounds.json" "$OUT"
  if [ -n "${JUSTAPI_BEFORE:-}" ]; then
    # the server measured second reads ~5% slower here whatever it holds (A/A, docs/benchmarks.md): the workloads
    # again with "before" listed first and a fresh seed (no prefix-cache hits from the first pass)
    echo "## before/after, reversed order: S1, W1, W2, W3 (seed 1), justapi-before listed first"
    for w in S1 W1 W2 W3; do
      # shellcheck disable=SC2046
      timeout 1800 "$J" bench serve --base-url "http://127.0.0.1:$PORT_BEFORE" --name justapi-before \
        --base-url "http://127.0.0.1:$PORT_JUSTAPI" --name justapi $(workload $w) --seed 1 \
        --json "$OUT/peers_${w}_reversed.json"
    done
    echo "## after / before, both orders"
    "$J" bench compare "$OUT"
  fi
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
