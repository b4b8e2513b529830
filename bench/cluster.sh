#!/usr/bin/env bash
# payledger on a MariaDB Galera cluster against payledger on one MariaDB server, measured side
# by side in one run on this machine: the same scenarios at CONCURRENCY callers on
#   single   one instance on the standalone server (127.0.0.1:3306);
#   node     one instance on Galera node 1 (every write replicated and certified, a causal
#            wait per transaction and read);
#   cluster  three instances, one per node, each loaded by CONCURRENCY/3 callers at once
#            (the rate is their sum).
# All of it shares this machine's cores, so the cluster cannot run faster than one server
# here: the figures are what replication, certification and the causal waits cost, not what
# more machines would add.
#
# Usage: bench/galera.sh start && bench/cluster.sh   (the cluster must be running; a cluster
#   started with GALERA_DIR / GALERA_PORT_BASE needs them exported here too). Needs the
#   standalone MariaDB on 127.0.0.1:3306 (root, no password), python3, and ports 50999-51002;
#   builds the release binaries first (bench/lib.sh). Each phase has a new database of its
#   own, dropped at the end.
# Environment: CONCURRENCY (30), COUNT (calls per scenario, 6000), POOL_SIZE (16),
#   SCENARIOS ("pay query mixed").
set -euo pipefail
cd "$(dirname "$0")/.."

CONCURRENCY="${CONCURRENCY:-30}"
COUNT="${COUNT:-6000}"
POOL_SIZE="${POOL_SIZE:-16}"
SCENARIOS="${SCENARIOS:-pay query mixed}"
# shellcheck source=bench/lib.sh
. bench/lib.sh

mapfile -t NODES < <(bash bench/galera.sh urls)
NAME="payledger_cluster_$$"
CLUSTER_PIDS=()

cluster_cleanup() {
  for pid in "${CLUSTER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${CLUSTER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for database in "$NAME" "${NAME}_cluster"; do
    mariadb --no-defaults -uroot -h127.0.0.1 -P"$(node_port 0)" -e "DROP DATABASE IF EXISTS $database" 2>/dev/null || true
  done
  cleanup
}
trap cluster_cleanup EXIT

node_port() { echo "${NODES[$1]}" | sed -E 's#.*:([0-9]+)/.*#\1#'; }
node_url() { echo "${NODES[$1]%/*}/${2:-$NAME}"; }

start_instance() { # port, database url
  "$BIN" serve --listen "127.0.0.1:$1" --database-url "$2" --pool-size "$POOL_SIZE" --log-filter warn \
    2>> "$RESULTS/cluster-server.log" &
  CLUSTER_PIDS+=($!)
  for _ in $(seq 1 100); do
    if "$BIN" health --target "http://127.0.0.1:$1" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "payledger on port $1 did not turn SERVING" >&2
  return 1
}

# Three benches at once, one per instance; prints the summed rate and the worst p99.
bench_three() { # label, scenario, ports...
  local label=$1 scenario=$2 port
  shift 2
  local each=$(( CONCURRENCY / $# ))
  local pids=()
  for port in "$@"; do
    "$TOOLS" bench --target "http://127.0.0.1:$port" --allow-test-data --scenario "$scenario" -c "$each" \
      -n $(( COUNT / $# )) --json > "$RESULTS/$label-$port.txt" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  python3 - "$label" "$RESULTS" "$@" <<'PY'
import json, sys
label, results, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
reports = []
for port in ports:
    for line in open(f"{results}/{label}-{port}.txt"):
        if line.startswith("bench-report: "):
            reports.append(json.loads(line[len("bench-report: "):]))
rate = sum(r["calls_per_second"] for r in reports)
p99 = max(r["latency_us"]["p99"] for r in reports) / 1000
errors = {}
for r in reports:
    for code, n in r["status_codes"].items():
        if code != "Ok":
            errors[code] = errors.get(code, 0) + n
json.dump({"calls_per_second": rate, "latency_us": {"p99": p99 * 1000}}, open(f"{results}/{label}.json", "w"))
print(f"  {label:<16} {rate:>9.1f} calls/s   p99 {p99:6.2f} ms (worst of {len(reports)})   errors {errors or 'none'}")
PY
}

echo "== single: one instance on the standalone MariaDB server"
create_my "${NAME}_single"
start_server "mysql://root@127.0.0.1:3306/${NAME}_single"
for scenario in $SCENARIOS; do bench "single-$scenario" "$scenario" "$CONCURRENCY"; done
stop_server

echo "== node: one instance on Galera node 1"
mariadb --no-defaults -uroot -h127.0.0.1 -P"$(node_port 0)" -e "CREATE DATABASE $NAME"
start_server "$(node_url 0)"
for scenario in $SCENARIOS; do bench "node-$scenario" "$scenario" "$CONCURRENCY"; done
stop_server

echo "== cluster: three instances, one per node, on a database of their own"
mariadb --no-defaults -uroot -h127.0.0.1 -P"$(node_port 0)" -e "CREATE DATABASE ${NAME}_cluster"
PORTS=()
for n in 0 1 2; do
  PORTS+=($(( PORT + 1 + n )))
  start_instance "${PORTS[$n]}" "$(node_url "$n" "${NAME}_cluster")"
done
for scenario in $SCENARIOS; do bench_three "cluster-$scenario" "$scenario" "${PORTS[@]}"; done
for pid in "${CLUSTER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
for pid in "${CLUSTER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
CLUSTER_PIDS=()

echo "== the audit, against every node"
for n in 0 1 2; do
  for database in "$NAME" "${NAME}_cluster"; do
    "$BIN" audit --database-url "$(node_url "$n" "$database")" | tail -n 1 | sed "s/^/  node $((n + 1)), $database: /"
  done
done

echo "== summary (rate, and ratio to single, of each scenario)"
for scenario in $SCENARIOS; do
  single=$(rate "single-$scenario")
  printf '  %-6s single %8.1f   node %8.1f (%s)   cluster %8.1f (%s)\n' "$scenario" "$single" \
    "$(rate "node-$scenario")" "$(ratio "$(rate "node-$scenario")" "$single")" \
    "$(rate "cluster-$scenario")" "$(ratio "$(rate "cluster-$scenario")" "$single")"
done
