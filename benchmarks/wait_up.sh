# Sourced by the benchmark scripts: wait_up PORT waits (up to 10 minutes) until a server on loopback PORT says ok.
wait_up() {
  for _ in $(seq 600); do
    curl -s "http://127.0.0.1:$1/health" | grep -q '"status":"ok"' && return 0
    sleep 1
  done
  echo "server on port $1 did not start" >&2; return 1
}
