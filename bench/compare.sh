#!/usr/bin/env bash
# Compares payledger's Pay with the database's own benchmark for the same transaction shape,
# in one run, on this machine, at the same concurrency:
#   PostgreSQL: pgbench tpcb-like (3 UPDATEs, a SELECT, an INSERT), prepared mode;
#   MariaDB/MySQL: sysbench oltp_write_only;
#   SQLite: payledger's pay figure alone (there is no server to compare with).
# Then every payledger scenario, the 128-caller overload, `pay` at half its peak rate, the
# server's peak resident memory and `payledger audit` on what the runs wrote. The database's
# benchmark runs before and after payledger and `pay` twice (the machine's speed drifts); the
# ratio compares means. Every database it creates is dropped again.
#
# Usage: bench/compare.sh [postgres|mysql|sqlite|all]   (default: all)
# Environment: CONCURRENCY (32), SECONDS_DB (20: length of the database's own run),
#   COUNT (calls per payledger scenario, 20000), POOL_SIZE (payledger's pool, 16),
#   PG_ADMIN (postgres://postgres@127.0.0.1:5432/postgres), MYSQL_ADMIN (mysql://root@127.0.0.1:3306/test).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS="${1:-all}"
CONCURRENCY="${CONCURRENCY:-32}"
SECONDS_DB="${SECONDS_DB:-20}"
COUNT="${COUNT:-20000}"
POOL_SIZE="${POOL_SIZE:-16}"
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
        mean = fields["group_committed_pays"] / fields["group_commits"]
        print(f"  group commits: {fields['group_commits']}, Pays in them: {fields['group_committed_pays']} (mean batch {mean:.1f})")
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

# The machine is shared and its speed drifts by tens of percent within minutes, so the
# database's own benchmark runs twice, before and after payledger, and payledger's `pay` twice,
# first and last; the ratio compares the two means. A warm-up round (not counted) lets the
# new tables get their statistics, as pgbench's and sysbench's own preparation does.
payledger_suite() { # database url, reference label, reference function, target ratio
  local url=$1 reference=$2 reference_run=$3 target=$4
  local before after
  before=$($reference_run)
  echo "  $reference, before payledger: $before tps"
  start_server "$url"
  COUNT=$(( COUNT / 4 )) bench warm-up pay "$CONCURRENCY"
  bench pay pay "$CONCURRENCY"
  local half
  half=$(python3 -c "print(round($(rate pay) / 2))")
  bench pay-half pay "$CONCURRENCY" --rate "$half"
  bench replay replay "$CONCURRENCY"
  bench hot hot "$CONCURRENCY"
  bench hot-zipf hot "$CONCURRENCY" --zipf 1.1
  bench refund refund "$CONCURRENCY"
  bench mixed mixed "$CONCURRENCY"
  bench pay-8 pay 8
  bench pay-128 pay 128
  bench pay-again pay "$CONCURRENCY"
  stop_server
  after=$($reference_run)
  echo "  $reference, after payledger: $after tps"
  "$BIN" audit --database-url "$url"
  local pay reference_tps
  pay=$(mean "$(rate pay)" "$(rate pay-again)")
  reference_tps=$(mean "$before" "$after")
  echo
  echo "  $reference: $reference_tps tps (mean of 2)   payledger pay: $pay calls/s (mean of 2)   ratio $(ratio "$pay" "$reference_tps") (target >= $target)"
  echo "  replay / pay: $(ratio "$(rate replay)" "$pay") (target >= 4)   hot / pay: $(ratio "$(rate hot)" "$pay") (target >= 0.5)"
  echo "  pay at 128 callers / pay at $CONCURRENCY: $(ratio "$(rate pay-128)" "$pay") (target >= 0.8)"
  echo "  p99 at half the peak rate ($half calls/s offered): $(p99 pay-half) ms (target <= 10)"
  echo "  server peak resident memory: $(( $(cat "$RESULTS/rss_kb") / 1024 )) MB (target <= 100)"
}

pgbench_run() {
  pgbench -h "$PG_HOST" -U postgres -M prepared -b tpcb-like -c "$CONCURRENCY" -j 2 -T "$SECONDS_DB" pgbench_reference 2>/dev/null \
    | awk '/^tps = / {print $3; exit}'
}

SB="sysbench oltp_write_only --db-driver=mysql --mysql-host=127.0.0.1 --mysql-user=root --mysql-db=sysbench_reference --tables=8 --table-size=10000"
sysbench_run() {
  $SB --threads="$CONCURRENCY" --time="$SECONDS_DB" run | awk '/transactions:/ {gsub(/\(/, "", $3); print $3; exit}'
}

if [ "$TARGETS" = all ] || [ "$TARGETS" = postgres ]; then
  need pgbench postgresql-contrib
  echo "== PostgreSQL: pgbench tpcb-like, prepared, $CONCURRENCY clients, ${SECONDS_DB}s; then payledger"
  create_pg pgbench_reference
  pgbench -h "$PG_HOST" -U postgres -i -q -s "$CONCURRENCY" pgbench_reference >/dev/null 2>&1
  create_pg payledger_bench
  payledger_suite "postgres://postgres@$PG_HOST:5432/payledger_bench" "pgbench tpcb-like" pgbench_run 1.0
fi

if [ "$TARGETS" = all ] || [ "$TARGETS" = mysql ]; then
  need sysbench sysbench
  echo "== MariaDB: sysbench oltp_write_only, $CONCURRENCY threads, ${SECONDS_DB}s; then payledger"
  create_my sysbench_reference
  $SB prepare >/dev/null
  create_my payledger_bench
  payledger_suite "mysql://root@127.0.0.1:3306/payledger_bench" "sysbench oltp_write_only" sysbench_run 0.8
fi

if [ "$TARGETS" = all ] || [ "$TARGETS" = sqlite ]; then
  echo "== SQLite (embedded): payledger"
  if [ -e /tmp/payledger_bench.db ]; then echo "/tmp/payledger_bench.db exists; not using it" >&2; exit 1; fi
  CREATED_SQLITE=/tmp/payledger_bench.db
  start_server "sqlite:/tmp/payledger_bench.db"
  COUNT=$(( COUNT / 4 )) bench warm-up pay "$CONCURRENCY"
  bench pay pay "$CONCURRENCY"
  stop_server
  "$BIN" audit --database-url "sqlite:/tmp/payledger_bench.db"
  echo "  server peak resident memory: $(( $(cat "$RESULTS/rss_kb") / 1024 )) MB"
fi
