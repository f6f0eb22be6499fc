#!/usr/bin/env bash
# Data-parallel replicas and their router (issue 30) on this machine, measured by one client in one run:
#   benchmarks/router_bench.sh
# Three JustAPI servers on loopback, SmolLM2-135M, defaults otherwise:
#   one          justapi serve                                        (one engine, torch on every core)
#   dp-prefix    justapi serve --data-parallel 2                      (two replicas, prefix-aware router)
#   dp-rr        justapi serve --data-parallel 2 --router round-robin (two replicas, round robin)
# Workload shared-prefix: PREFIXES prefixes of PREFIX_LEN tokens, SUFFIXES requests each (32-token tails, 32 output
# tokens), shuffled, Poisson arrivals at RATE/s. Each server's prefix-cache hit ratio is read from its /metrics after
# its run. RAY=1 adds the two replicas as Ray Serve deployments (--distributed-executor ray), prefix and round robin.
# Results: bench_results/router_*.json and bench_results/router_bench.txt.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
J=$ROOT/.venv/bin/justapi
OUT=$ROOT/bench_results
mkdir -p "$OUT"
PREFIXES=${PREFIXES:-8} SUFFIXES=${SUFFIXES:-8} PREFIX_LEN=${PREFIX_LEN:-512} RATE=${RATE:-1.5}
NAMES=(one dp-prefix dp-rr)
FLAGS=("" "--data-parallel 2" "--data-parallel 2 --router round-robin")
PORTS=(8030 8031 8032)
if [ "${RAY:-0}" = 1 ]; then  # the same two replicas as Ray Serve deployments (a local Ray each; pip install '.[ray]')
  NAMES+=(serve-prefix serve-rr)
  FLAGS+=("--data-parallel 2 --distributed-executor ray" "--data-parallel 2 --distributed-executor ray --router round-robin")
  PORTS+=(8033 8034)
fi
# shellcheck source=benchmarks/wait_up.sh
source "$ROOT/benchmarks/wait_up.sh"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT
{
  echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), commit" \
    "$(git -C "$ROOT" rev-parse --short HEAD); shared-prefix $PREFIXES x $SUFFIXES, prefixes of $PREFIX_LEN tokens," \
    "$RATE req/s"
  for i in "${!NAMES[@]}"; do  # one server at a time: each has the machine to itself
    # shellcheck disable=SC2086
    "$J" serve --port "${PORTS[$i]}" ${FLAGS[$i]} > "$OUT/router_${NAMES[$i]}.log" 2>&1 &
    PIDS+=($!)
    wait_up "${PORTS[$i]}" || exit 1
    timeout 1200 "$J" bench serve --base-url "http://127.0.0.1:${PORTS[$i]}" --name "${NAMES[$i]}" \
      --workload shared-prefix --num-prefixes "$PREFIXES" --suffixes-per-prefix "$SUFFIXES" \
      --prefix-len "$PREFIX_LEN" --input-len 32 --output-len 32 --request-rate "$RATE" --max-concurrency 32 \
      --seed 1 --json "$OUT/router_${NAMES[$i]}.json"
    sleep 1  # the replicas report every 0.25 s
    echo "## ${NAMES[$i]} /metrics after its run"
    curl -s "http://127.0.0.1:${PORTS[$i]}/metrics" | grep -E '^prefix_cache_hit|^justapi_worker_(requests_routed|prefix_cache_hits)'
    kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null
    [ "${RAY:-0}" = 1 ] && "$ROOT/.venv/bin/ray" stop --force > /dev/null 2>&1  # nothing of a Ray left for the next
  done
} 2>&1 | tee "$OUT/router_bench.txt"
