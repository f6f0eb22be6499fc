#!/usr/bin/env bash
# Colocated vs disaggregated serving (issue 9) on this machine, measured by one client in one run:
#   benchmarks/pd_bench.sh
# Two JustAPI servers on loopback, both SmolLM2-135M, --dtype auto:
#   colocated      justapi serve                    (one engine, torch uses both cores)
#   disaggregated  justapi serve --disaggregate     (1 prefill + 1 decode worker, one core each)
# Workload `burst`: steady requests (16-64-token prompts, OUT output tokens) at RATE per second, plus every EVERY s a
# burst of SIZE prompts of 1024 tokens (as many output tokens as the minimum of OUT). Goodput targets, fixed before the first run: TTFT <= 2000 ms
# and TPOT <= 100 ms. Defaults: the lighter load of docs/benchmarks.md; HEAVY=1 the overload run (1/s, 64-128 tokens,
# 4 long prompts every 8 s). Results: bench_results/pd.json and bench_results/pd_bench.txt.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
J=$ROOT/.venv/bin/justapi
OUT=$ROOT/bench_results
mkdir -p "$OUT"
PORT_CO=${PORT_CO:-8020}
PORT_PD=${PORT_PD:-8021}
if [ "${HEAVY:-0}" = 1 ]; then NUM=40 RATE=1 OUT_LEN=64:128 EVERY=8 SIZE=4
else NUM=24 RATE=0.5 OUT_LEN=32:64 EVERY=12 SIZE=2; fi
# shellcheck source=benchmarks/wait_up.sh
source "$ROOT/benchmarks/wait_up.sh"
"$J" serve --port "$PORT_CO" > "$OUT/pd_colocated.log" 2>&1 &
CO=$!
"$J" serve --disaggregate --port "$PORT_PD" > "$OUT/pd_disaggregated.log" 2>&1 &
PD=$!
trap 'kill $CO $PD 2>/dev/null; wait' EXIT
wait_up "$PORT_CO" && wait_up "$PORT_PD" || exit 1
{
  echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2);" \
    "steady $NUM at $RATE/s, $OUT_LEN tokens; bursts of $SIZE x 1024 tokens every $EVERY s"
  timeout 1200 "$J" bench serve --base-url "http://127.0.0.1:$PORT_CO" --name colocated \
    --base-url "http://127.0.0.1:$PORT_PD" --name disaggregated \
    --workload burst --num-requests "$NUM" --steady-rate "$RATE" --output-len "$OUT_LEN" \
    --burst-every "$EVERY" --burst-size "$SIZE" --burst-input-len 1024 \
    --goodput ttft:2000 tpot:100 --json "$OUT/pd.json"
  sleep 1  # the workers report every 0.25 s
  echo "## disaggregated /metrics after the run"
  curl -s "http://127.0.0.1:$PORT_PD/metrics" | grep -E '^justapi_pd_' 
} 2>&1 | tee "$OUT/pd_bench.txt"
