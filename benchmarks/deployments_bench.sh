#!/usr/bin/env bash
# JustAPI's deployments of more than one engine process against the plain server, on this machine, measured by one
# client (`justapi bench serve`) in one run, every server on loopback serving SmolLM2-135M:
#   benchmarks/deployments_bench.sh router    data-parallel replicas and their router (issue 30)
#   benchmarks/deployments_bench.sh pd        colocated against disaggregated serving (issue 9)
#
# router: three servers, one at a time (each has the machine to itself), defaults otherwise:
#   one          justapi serve                                        (one engine, torch on every core)
#   dp-prefix    justapi serve --data-parallel 2                      (two replicas, prefix-aware router)
#   dp-rr        justapi serve --data-parallel 2 --router round-robin (two replicas, round robin)
# Workload shared-prefix: PREFIXES prefixes of PREFIX_LEN tokens, SUFFIXES requests each (32-token tails, 32 output
# tokens), shuffled, Poisson arrivals at RATE/s. Each server's prefix-cache hit ratio is read from its /metrics after
# its run. RAY=1 adds the two replicas as Ray Serve deployments (--distributed-executor ray), prefix and round robin.
# Results: bench_results/router_*.json and bench_results/router_bench.txt.
#
# pd: two servers up together, --dtype auto, measured one after the other:
#   colocated      justapi serve                    (one engine, torch uses both cores)
#   disaggregated  justapi serve --disaggregate     (1 prefill + 1 decode worker, one core each)
# Workload `burst`: steady requests (16-64-token prompts, 32-64 output tokens) at 0.5 per second, plus every 12 s a
# burst of 2 prompts of 1024 tokens (as many output tokens as the minimum of the steady ones). Goodput targets, fixed
# before the first run: TTFT <= 2000 ms and TPOT <= 100 ms. Defaults: the lighter load of docs/benchmarks.md; HEAVY=1
# the overload run (1/s, 64-128 tokens, 4 long prompts every 8 s). Ports: PORT_CO, PORT_PD.
# Results: bench_results/pd.json and bench_results/pd_bench.txt.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
J=$ROOT/.venv/bin/justapi
OUT=$ROOT/bench_results
mkdir -p "$OUT"
# shellcheck source=benchmarks/wait_up.sh
source "$ROOT/benchmarks/wait_up.sh"
PIDS=()

serve() {  # serve LOG PORT [FLAGS...]: a JustAPI server on loopback PORT in the background, its output in LOG
  local log=$1 port=$2
  shift 2
  "$J" serve --port "$port" "$@" > "$log" 2>&1 &
  PIDS+=($!)
}
stop_last() {  # the server started last, stopped and waited for
  kill "${PIDS[-1]}" 2>/dev/null; wait "${PIDS[-1]}" 2>/dev/null
  unset 'PIDS[-1]'
}
stop_all() { [ ${#PIDS[@]} -gt 0 ] && kill "${PIDS[@]}" 2>/dev/null; wait; }
machine() { echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; }

router() {
  trap stop_all EXIT  # this runs in the pipeline's subshell, which does not inherit the script's traps
  local prefixes=${PREFIXES:-8} suffixes=${SUFFIXES:-8} prefix_len=${PREFIX_LEN:-512} rate=${RATE:-1.5}
  local names=(one dp-prefix dp-rr) flags=("" "--data-parallel 2" "--data-parallel 2 --router round-robin")
  local ports=(8030 8031 8032) i
  if [ "${RAY:-0}" = 1 ]; then  # the same two replicas as Ray Serve deployments (a local Ray each; pip install '.[ray]')
    names+=(serve-prefix serve-rr)
    flags+=("--data-parallel 2 --distributed-executor ray" "--data-parallel 2 --distributed-executor ray --router round-robin")
    ports+=(8033 8034)
  fi
  echo "$(machine), commit $(git -C "$ROOT" rev-parse --short HEAD); shared-prefix $prefixes x $suffixes," \
    "prefixes of $prefix_len tokens, $rate req/s"
  for i in "${!names[@]}"; do  # one server at a time: each has the machine to itself
    # shellcheck disable=SC2086 # the flags are words
    serve "$OUT/router_${names[$i]}.log" "${ports[$i]}" ${flags[$i]}
    wait_up "${ports[$i]}" || exit 1
    timeout 1200 "$J" bench serve --base-url "http://127.0.0.1:${ports[$i]}" --name "${names[$i]}" \
      --workload shared-prefix --num-prefixes "$prefixes" --suffixes-per-prefix "$suffixes" \
      --prefix-len "$prefix_len" --input-len 32 --output-len 32 --request-rate "$rate" --max-concurrency 32 \
      --seed 1 --json "$OUT/router_${names[$i]}.json"
    sleep 1  # the replicas report every 0.25 s
    echo "## ${names[$i]} /metrics after its run"
    curl -s "http://127.0.0.1:${ports[$i]}/metrics" | grep -E '^prefix_cache_hit|^justapi_worker_(requests_routed|prefix_cache_hits)'
    stop_last
    if [ "${RAY:-0}" = 1 ]; then "$ROOT/.venv/bin/ray" stop --force > /dev/null 2>&1; fi  # no Ray left for the next
  done
}

pd() {
  trap stop_all EXIT
  local port_co=${PORT_CO:-8020} port_pd=${PORT_PD:-8021} num rate out_len every size
  if [ "${HEAVY:-0}" = 1 ]; then num=40 rate=1 out_len=64:128 every=8 size=4
  else num=24 rate=0.5 out_len=32:64 every=12 size=2; fi
  serve "$OUT/pd_colocated.log" "$port_co"
  serve "$OUT/pd_disaggregated.log" "$port_pd" --disaggregate
  wait_up "$port_co" && wait_up "$port_pd" || exit 1
  echo "$(machine); steady $num at $rate/s, $out_len tokens; bursts of $size x 1024 tokens every $every s"
  timeout 1200 "$J" bench serve --base-url "http://127.0.0.1:$port_co" --name colocated \
    --base-url "http://127.0.0.1:$port_pd" --name disaggregated \
    --workload burst --num-requests "$num" --steady-rate "$rate" --output-len "$out_len" \
    --burst-every "$every" --burst-size "$size" --burst-input-len 1024 \
    --goodput ttft:2000 tpot:100 --json "$OUT/pd.json"
  sleep 1  # the workers report every 0.25 s
  echo "## disaggregated /metrics after the run"
  curl -s "http://127.0.0.1:$port_pd/metrics" | grep -E '^justapi_pd_'
}

case "${1:-}" in
  router|pd) "$1" 2>&1 | tee "$OUT/${1}_bench.txt" ;;
  *) echo "usage: $0 router|pd   (what each measures: the comment at the top of $0)" >&2; exit 2 ;;
esac
