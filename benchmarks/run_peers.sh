#!/usr/bin/env bash
# JustAPI beside llama.cpp's server and vLLM's CPU build, one after another in one run, same client.
#   benchmarks/run_peers.sh single          single-stream prefill/decode: justapi, llama.cpp, transformers
#   benchmarks/run_peers.sh serve W1 [W2 S1] vllm bench serve workloads: justapi static, justapi continuous,
#                                            llama.cpp, vLLM
# Needs the peers installed with the recipes in ../shared/peers (README there). Servers bind 127.0.0.1 only.
# Results: $PEERS/results/ (JSON + logs) and bench_results/ in this repo.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STEER=${STEER:-$ROOT/../shared/peers}
source "$STEER/env.sh"
PY=$ROOT/.venv/bin/python
PORT_JUSTAPI=${PORT_JUSTAPI:-8010}
OUT=$ROOT/bench_results
mkdir -p "$OUT" "$PEERS/run" "$PEERS/logs"
# llama.cpp's ggml AMX kernels crash on this machine's CPU (general protection fault); --no-repack avoids them.
export LLAMA_EXTRA=${LLAMA_EXTRA:---no-repack}

start_justapi() {  # start_justapi LABEL [extra flags...]
  local label=$1; shift
  setsid "$ROOT/.venv/bin/justapi" serve --port "$PORT_JUSTAPI" --served-model-name "$SERVED_NAME" \
    --pool-blocks "${JUSTAPI_POOL_BLOCKS:-4096}" "$@" > "$PEERS/logs/justapi-$label.log" 2>&1 < /dev/null &
  echo $! > "$PEERS/run/justapi.pid"
  "$STEER/wait_ready.sh" "$PORT_JUSTAPI" 300 "$PEERS/run/justapi.pid" "$PEERS/logs/justapi-$label.log"
}
stop_justapi() { "$STEER/stop_server.sh" justapi; }

case ${1:-} in
  single)
    start_justapi single --scheduled
    "$STEER/start_llama_server.sh"
    "$PY" "$ROOT/benchmarks/single_stream.py" --server "justapi=http://127.0.0.1:$PORT_JUSTAPI" \
      --server "llama.cpp=http://127.0.0.1:$PORT_LLAMA_SERVER" --model "$SERVED_NAME" --hf "$GGUF" \
      --json "$OUT/single_stream.json"
    "$STEER/stop_server.sh" llama_server
    stop_justapi
    ;;
  serve)
    shift
    WLS=("$@"); [ ${#WLS[@]} -gt 0 ] || WLS=(W1)
    for W in "${WLS[@]}"; do
      start_justapi static
      "$STEER/bench_serve.sh" justapi-static "$PORT_JUSTAPI" "$W" r1 | grep -E '^(Successful|Failed|Benchmark duration|Output token|Median|P99)'
      stop_justapi
      start_justapi continuous --scheduled
      "$STEER/bench_serve.sh" justapi-continuous "$PORT_JUSTAPI" "$W" r1 | grep -E '^(Successful|Failed|Benchmark duration|Output token|Median|P99)'
      stop_justapi
      "$STEER/start_llama_server.sh" && \
        "$STEER/bench_serve.sh" llama_server "$PORT_LLAMA_SERVER" "$W" r1 | grep -E '^(Successful|Failed|Benchmark duration|Output token|Median|P99)'
      "$STEER/stop_server.sh" llama_server
      "$STEER/start_vllm.sh" && \
        "$STEER/bench_serve.sh" vllm "$PORT_VLLM" "$W" r1 | grep -E '^(Successful|Failed|Benchmark duration|Output token|Median|P99)'
      "$STEER/stop_server.sh" vllm
    done
    "$PY" "$ROOT/benchmarks/summarize.py" "$PEERS/results" "${WLS[@]}" | tee "$OUT/serve_summary.md"
    ;;
  *) echo "usage: $0 single | serve [W1 W2 S1]"; exit 2 ;;
esac
