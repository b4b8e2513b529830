#!/usr/bin/env bash
# The cost of payledger's calls as the ledger grows, measured side by side in one run: for
# each ledger size, a new database is filled by `payledger-tools seed` (paid orders, a tenth
# of them refunded, over size/100 payers and 1,000 merchants), analyzed (as autovacuum would
# have by then), and loaded with `pay`, `replay`, `query` and `refund` at CONCURRENCY callers.
# Then the server stops and `payledger audit` runs on everything. Printed per size: rates and
# p99, the database's size and bytes on disk per payment (with the biggest tables and
# indexes), sequential scans of hot tables during the runs (PostgreSQL), the seed's and the
# audit's times. The empty ledger runs first and last: the machine's speed drifts, and the
# ratio to each is printed. Each database is dropped before the next size is seeded.
#
# Usage: bench/scale.sh [postgres|mysql|sqlite|all]   (default: all)
# Environment: SIZES (paid orders per ledger; "0 1000000 10000000 0", and for SQLite
#   SQLITE_SIZES, "0 1000000 0"), CONCURRENCY (32), COUNT (calls per scenario, 10000),
#   POOL_SIZE (16).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS="${1:-all}"
SIZES="${SIZES:-0 1000000 10000000 0}"
SQLITE_SIZES="${SQLITE_SIZES:-0 1000000 0}"
CONCURRENCY="${CONCURRENCY:-32}"
COUNT="${COUNT:-10000}"
POOL_SIZE="${POOL_SIZE:-16}"
# shellcheck source=bench/lib.sh
. bench/lib.sh

SUMMARY="$RESULTS/summary.tsv"
HOT="'orders','payment_flow','refunds','accounts','journal_entries','idempotency_record'"

seed() { # url, orders
  if [ "$2" -eq 0 ]; then echo 0; return; fi
  local started
  started=$(date +%s.%N)
  "$TOOLS" seed --database-url "$1" --allow-test-data --orders "$2" --payers $(( $2 / 100 > 0 ? $2 / 100 : 1 )) \
    --merchants 1000 > "$RESULTS/seed.txt"
  python3 -c "import time; print(round(time.time() - $started, 1))"
}

# Prints "<bytes> <the three biggest tables with their indexes>" for a PostgreSQL database.
size_pg() {
  psql -h "$PG_HOST" -U postgres -d "$1" -At -F ' ' -c "
    SELECT (SELECT SUM(pg_total_relation_size(relid)) FROM pg_stat_user_tables),
      (SELECT string_agg(relname || ' ' || pg_size_pretty(size) || ' (indexes ' || pg_size_pretty(indexes) || ')', ', ')
       FROM (SELECT relname, pg_total_relation_size(relid) AS size, pg_indexes_size(relid) AS indexes
             FROM pg_stat_user_tables ORDER BY 2 DESC LIMIT 3) t)"
}
size_my() {
  mariadb -uroot -h127.0.0.1 -N -e "
    SELECT (SELECT SUM(DATA_LENGTH + INDEX_LENGTH) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '$1'),
      (SELECT GROUP_CONCAT(CONCAT(TABLE_NAME, ' ', ROUND((DATA_LENGTH + INDEX_LENGTH) / 1048576), ' MB (indexes ',
         ROUND(INDEX_LENGTH / 1048576), ' MB)') ORDER BY DATA_LENGTH + INDEX_LENGTH DESC SEPARATOR ', ')
       FROM (SELECT * FROM information_schema.TABLES WHERE TABLE_SCHEMA = '$1'
             ORDER BY DATA_LENGTH + INDEX_LENGTH DESC LIMIT 3) t)" | tr '\t' ' '
}
size_sqlite() {
  python3 - "$1" <<'PY'
import os, sqlite3, sys
path = sys.argv[1]
total = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
try:
    rows = sqlite3.connect(path).execute(
        "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC LIMIT 3").fetchall()
    biggest = ", ".join(f"{name} {size // 1048576} MB" for name, size in rows)
except sqlite3.Error:
    biggest = "(no dbstat in this sqlite3 module)"
print(total, biggest)
PY
}
# "<table> <sequential scans so far>" per hot table.
seq_scans_pg() {
  psql -h "$PG_HOST" -U postgres -d "$1" -At -F ' ' -c "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE relname IN ($HOT)"
}
# The hot tables scanned between two readings: "none" or "<table> <scans>, ...".
scans_between() {
  python3 - "$1" "$2" <<'PY'
import sys
def reading(text):
    return {name: int(count) for name, count in (line.split() for line in text.splitlines() if line.strip())}
before, after = reading(sys.argv[1]), reading(sys.argv[2])
moved = [f"{name} {after[name] - before.get(name, 0)}" for name in sorted(after) if after[name] != before.get(name, 0)]
print(", ".join(moved) or "none")
PY
}

# One ledger size on one backend: backend label, url, size, database name (or file).
measure() {
  local backend=$1 url=$2 size=$3 name=$4 round=$5
  local seeded bytes biggest scans_before scans_after audit_started audit_seconds label
  echo "-- $backend, $size paid orders"
  seeded=$(seed "$url" "$size")
  bytes=0 biggest="" scans_before=""
  if [ "$size" -gt 0 ]; then
    case $backend in
      postgres) analyze_pg "$name"; read -r bytes biggest <<<"$(size_pg "$name")"; scans_before=$(seq_scans_pg "$name") ;;
      mysql) analyze_my "$name"; read -r bytes biggest <<<"$(size_my "$name")" ;;
      sqlite) analyze_sqlite "$name"; read -r bytes biggest <<<"$(size_sqlite "$name")" ;;
    esac
    echo "  seeded in $seeded s; on disk $(( bytes / 1048576 )) MB: $biggest"
  fi
  start_server "$url"
  label="$backend-$round"
  for scenario in pay replay query refund; do
    bench "$label-$scenario" "$scenario" "$CONCURRENCY"
  done
  stop_server
  scans_after="-"
  if [ "$backend" = postgres ] && [ "$size" -gt 0 ]; then
    # The server's sessions flushed their statistics when they ended; read them once they have.
    sleep 1
    scans_after=$(scans_between "$scans_before" "$(seq_scans_pg "$name")")
    echo "  sequential scans of hot tables during the runs: $scans_after"
  fi
  audit_started=$(date +%s.%N)
  "$BIN" audit --database-url "$url"
  audit_seconds=$(python3 -c "import time; print(round(time.time() - $audit_started, 1))")
  echo "  audit: $audit_seconds s"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$backend" "$round" "$size" "$bytes" "$seeded" "$audit_seconds" \
    "$scans_after" "$biggest" >> "$SUMMARY"
}

run_sizes() { # backend, sizes
  local backend=$1 round=0 size name
  for size in $2; do
    round=$(( round + 1 ))
    case $backend in
      postgres)
        name="payledger_scale_$round"
        create_pg "$name"
        measure postgres "postgres://postgres@$PG_HOST:5432/$name" "$size" "$name" "$round"
        drop_pg "$name" ;;
      mysql)
        name="payledger_scale_$round"
        create_my "$name"
        measure mysql "mysql://root@127.0.0.1:3306/$name" "$size" "$name" "$round"
        drop_my "$name" ;;
      sqlite)
        name="/tmp/payledger_scale_$round.db"
        if [ -e "$name" ]; then echo "$name exists; not using it" >&2; exit 1; fi
        CREATED_SQLITE=$name
        measure sqlite "sqlite:$name" "$size" "$name" "$round"
        rm -f "$name" "$name-wal" "$name-shm" ;;
    esac
  done
}

if [ "$TARGETS" = all ] || [ "$TARGETS" = postgres ]; then
  echo "== PostgreSQL ($(autovacuum_pg))"
  run_sizes postgres "$SIZES"
fi
if [ "$TARGETS" = all ] || [ "$TARGETS" = mysql ]; then
  echo "== MariaDB ($(autovacuum_my))"
  run_sizes mysql "$SIZES"
fi
if [ "$TARGETS" = all ] || [ "$TARGETS" = sqlite ]; then
  echo "== SQLite"
  run_sizes sqlite "$SQLITE_SIZES"
fi

echo
echo "== summary: calls/s (p99 ms) at $CONCURRENCY callers; pay / pay on the empty ledger (first, last run)"
python3 - "$SUMMARY" "$RESULTS" <<'PY'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
def report(label, scenario):
    return json.load(open(f"{sys.argv[2]}/{label}-{scenario}.json"))
print("| backend | paid orders | pay | replay | query | refund | pay / empty | on disk | bytes per payment | audit | seed |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for backend in dict.fromkeys(row[0] for row in rows):
    mine = [row for row in rows if row[0] == backend]
    empties = [report(f"{backend}-{row[1]}", "pay")["calls_per_second"] for row in mine if row[2] == "0"]
    for name, round_, size, size_bytes, seeded, audit, scans, biggest in mine:
        cells = []
        for scenario in ("pay", "replay", "query", "refund"):
            r = report(f"{backend}-{round_}", scenario)
            bad = sum(n for code, n in r["status_codes"].items() if code != "Ok")
            cells.append(f"{r['calls_per_second']:.0f} ({r['latency_us']['p99'] / 1000:.1f})" + (f" {bad} errors" if bad else ""))
        pay = report(f"{backend}-{round_}", "pay")["calls_per_second"]
        ratios = " / ".join(f"{pay / empty:.2f}" for empty in empties)
        per_payment = f"{int(size_bytes) / int(size):.0f}" if int(size) else "-"
        print(f"| {backend} | {int(size):,} | {' | '.join(cells)} | {ratios} | {int(size_bytes) / 1048576:,.0f} MB "
              f"| {per_payment} | {audit} s | {seeded} s |")
PY
