# Shared by the benchmark scripts (sourced, from the repository's root): the release build,
# databases the script creates (and only those, dropped on exit), a payledger server on
# $PORT, one bench scenario with its report, and the arithmetic of the summaries.
# Callers set CONCURRENCY, COUNT and POOL_SIZE first.
PG_HOST=127.0.0.1
PORT=50999
BIN=target/release/payledger
TOOLS=target/release/payledger-tools
RESULTS="$(mktemp -d)"
SERVER_PID=""

# What this script created, and so may drop: never a database or file that was there before.
CREATED_PG=()
CREATED_MY=()
CREATED_SQLITE=""

cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  for db in "${CREATED_PG[@]}"; do
    psql -h "$PG_HOST" -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" 2>/dev/null || true
  done
  for db in "${CREATED_MY[@]}"; do
    mariadb -uroot -h127.0.0.1 -e "DROP DATABASE IF EXISTS $db" 2>/dev/null || true
  done
  if [ -n "$CREATED_SQLITE" ]; then rm -f "$CREATED_SQLITE" "$CREATED_SQLITE-wal" "$CREATED_SQLITE-shm"; fi
}
trap cleanup EXIT

# Creates a database this script then owns; fails (and drops nothing) when it exists.
create_pg() { createdb -h "$PG_HOST" -U postgres "$1" && CREATED_PG+=("$1"); }
create_my() { mariadb -uroot -h127.0.0.1 -e "CREATE DATABASE $1" && CREATED_MY+=("$1"); }

need() { # tool, Debian package
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "installing $2"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >/dev/null
  fi
}

cargo build --release --locked --quiet

start_server() { # database url
  # The server's last log line ("stopped") has the group-commit counters: mean batch size.
  "$BIN" serve --listen "127.0.0.1:$PORT" --database-url "$1" --pool-size "$POOL_SIZE" \
    --log-filter warn,payledger::startup=info --log-format json 2> "$RESULTS/server.log" &
  SERVER_PID=$!
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "payledger did not start" >&2
  return 1
}

stop_server() {
  grep -E '^VmHWM' "/proc/$SERVER_PID/status" | awk '{print $2}' > "$RESULTS/rss_kb" || echo 0 > "$RESULTS/rss_kb"
  kill "$SERVER_PID"
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
  python3 - "$RESULTS/server.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        event = json.loads(line)
    except ValueError:
        continue
    fields = event.get("fields", {})
    if fields.get("message") == "stopped" and fields.get("group_commits"):
        pays, refunds = fields["group_committed_pays"], fields.get("group_committed_refunds", 0)
        transfers = fields.get("group_committed_transfers", 0)
        deposits = fields.get("group_committed_deposits", 0)
        withdrawals = fields.get("group_committed_withdrawals", 0)
        orders = fields.get("group_committed_orders", 0)
        mean = (pays + refunds + transfers + deposits + withdrawals + orders) / fields["group_commits"]
        print(f"  group commits: {fields['group_commits']}, Pays in them: {pays}, Refunds: {refunds}, "
              f"Transfers: {transfers}, Deposits: {deposits}, Withdraws: {withdrawals}, "
              f"CreateOrders: {orders} (mean batch {mean:.1f})")
PY
}

bench() { # label, scenario, concurrency, extra args...
  local label=$1 scenario=$2 concurrency=$3
  shift 3
  "$TOOLS" bench --target "http://127.0.0.1:$PORT" --allow-test-data --scenario "$scenario" -c "$concurrency" -n "$COUNT" --json "$@" \
    > "$RESULTS/$label.txt" 2>&1
  grep '^bench-report: ' "$RESULTS/$label.txt" | sed 's/^bench-report: //' > "$RESULTS/$label.json"
  python3 - "$RESULTS/$label.json" "$label" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
errors = {code: n for code, n in report["status_codes"].items() if code != "Ok"}
print(f"  {sys.argv[2]:<16} {report['calls_per_second']:>9.1f} calls/s   p50 {report['latency_us']['p50']/1000:6.2f} ms"
      f"   p99 {report['latency_us']['p99']/1000:6.2f} ms   errors {errors or 'none'}")
PY
}

rate() { python3 -c "import json;print(json.load(open('$RESULTS/$1.json'))['calls_per_second'])"; }
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
p99() { python3 -c "import json;print(json.load(open('$RESULTS/$1.json'))['latency_us']['p99']/1000)"; }

mean() { python3 -c "print(round(($1 + $2) / 2, 1))"; }

# Drops a database this script created, before the end of the run (to free its disk).
drop_pg() { psql -h "$PG_HOST" -U postgres -qc "DROP DATABASE IF EXISTS $1 WITH (FORCE)"; }
drop_my() { mariadb -uroot -h127.0.0.1 -e "DROP DATABASE IF EXISTS $1"; }

# payledger's tables.
LEDGER_TABLES="accounts journal_entries orders payment_flow refunds deposits idempotency_record idempotency_token transfers"

# Takes fresh statistics of payledger's tables, as `pgbench -i` does of its own after loading
# them (payledger's plans do not depend on them: see docs/benchmarks-history.md, "Ledger size").
analyze_pg() { psql -h "$PG_HOST" -U postgres -d "$1" -qc "ANALYZE"; }
analyze_my() {
  local tables
  tables=$(echo "$LEDGER_TABLES" | sed 's/ /, /g')
  mariadb -uroot -h127.0.0.1 "$1" -e "ANALYZE TABLE $tables" >/dev/null
}
analyze_sqlite() { python3 -c 'import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute("ANALYZE"); c.commit()' "$1"; }

# The database's own upkeep of statistics, printed with the results.
autovacuum_pg() {
  psql -h "$PG_HOST" -U postgres -Atc "SELECT 'autovacuum ' || current_setting('autovacuum') || ', analyze scale factor ' || current_setting('autovacuum_analyze_scale_factor')"
}
autovacuum_my() {
  mariadb -uroot -h127.0.0.1 -N -e "SELECT CONCAT('innodb_stats_persistent ', @@innodb_stats_persistent, ', innodb_stats_auto_recalc ', @@innodb_stats_auto_recalc)"
}
