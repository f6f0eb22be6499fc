#!/usr/bin/env bash
# What the dashboard costs a loaded server (issue 31): W1 and W2 (benchmarks/workloads.txt) against one JustAPI
# server, alternately with nobody watching and with a page's event stream open (/dashboard/events read by curl, as a
# browser's EventSource reads it; drawing happens in the browser, on the operator's machine), ROUNDS times each.
#   benchmarks/dashboard_cost.sh            # ROUNDS=2 PORT=8030 by default; results in bench_results/dashboard_*.json
# The unwatched engine still records its steps: that cost is measured by peers_bench.sh before/after the change.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${PORT:-8030}
ROUNDS=${ROUNDS:-2}
OUT=$ROOT/bench_results
J=$ROOT/.venv/bin/justapi
mkdir -p "$OUT"
workload() { sed -n "s/^$1 //p" "$ROOT/benchmarks/workloads.txt"; }
"$J" serve --port "$PORT" > "$OUT/dashboard_serve.log" 2>&1 &
server=$!
watcher=
trap 'kill $server $watcher 2>/dev/null || true' EXIT
source "$ROOT/benchmarks/wait_up.sh"
wait_up "$PORT" 300
for round in $(seq "$ROUNDS"); do
  for w in W1 W2; do
    for mode in unwatched watched; do
      if [ "$mode" = watched ]; then
        curl -sN "http://127.0.0.1:$PORT/dashboard/events" > "$OUT/dashboard_events.txt" & watcher=$!
        sleep 1
      fi
      # shellcheck disable=SC2046 # the workload's flags are words
      "$J" bench serve --base-url "http://127.0.0.1:$PORT" --name "$mode" $(workload "$w") \
        --json "$OUT/dashboard_${w}_${mode}_$round.json" > /dev/null
      if [ -n "$watcher" ]; then
        kill "$watcher"; wait "$watcher" 2>/dev/null || true; watcher=
        echo "$w round $round: the watcher read $(grep -c '^data:' "$OUT/dashboard_events.txt") messages," \
          "$(du -k "$OUT/dashboard_events.txt" | cut -f1) KiB"
      fi
    done
  done
done
"$ROOT/.venv/bin/python" - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("| workload | figure | unwatched | watched | watched / unwatched |")
print("|---|---|---|---|---|")
for w in ("W1", "W2"):
    fig = {m: [json.load(open(f"{out}/dashboard_{w}_{m}_{r}.json"))["servers"][0]["figures"]
               for r in range(1, rounds + 1)] for m in ("unwatched", "watched")}
    rows = (("out tok/s", lambda f: f["output_throughput"]), ("TTFT p50 ms", lambda f: f["ttft_ms"]["p50"]),
            ("TPOT p50 ms", lambda f: f["tpot_ms"]["p50"]))
    for name, get in rows:
        a = [get(f) for f in fig["unwatched"]]
        b = [get(f) for f in fig["watched"]]
        mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
        print(f"| {w} | {name} | {' / '.join(f'{x:.1f}' for x in a)} | {' / '.join(f'{x:.1f}' for x in b)} | "
              f"{mean_b / mean_a:.3f} |")
EOF
