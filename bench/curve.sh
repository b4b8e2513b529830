#!/usr/bin/env bash
# The concurrency curve: payledger's write paths (`pay`, `keyed-pay`, `transfer`, `refund`) at
# 1, 2, 8, 32 and 128 callers, each concurrency interleaved with the database's own benchmark
# at the same number of clients, in one run on this machine:
#   PostgreSQL: pgbench tpcb-like, prepared mode (-s 32);
#   MariaDB/MySQL: sysbench oltp_write_only (8 tables of 10,000 rows).
# Prints calls/s, p50 and p99 of every run and its ratio to the database's benchmark, writes
# the figures to $OUT/curve-<backend>.csv and draws each backend's CSV, alone, as
# $OUT/curve-<backend>.svg (bench/curve_plot.py: calls/s, p50 and p99 against callers, the
# four scenarios beside the database's benchmark; matplotlib, in a virtual environment made
# once under target/bench-venv), which BENCHMARKS.md shows. The database's benchmark cannot
# run where it needs more connections than the server allows (pgbench at 128 clients on
# PostgreSQL's default max_connections = 100): that point is printed as "n/a" and left out of
# the ratios and the picture. Every database it creates is dropped again. To redraw a picture
# from its CSV: target/bench-venv/bin/python bench/curve_plot.py $OUT/curve-postgres.csv
# $OUT/curve-postgres.svg.
#
# Usage: bench/curve.sh [postgres|mysql|all]   (default: all)
# Environment: CONCURRENCIES ("1 2 8 32 128"), SECONDS_RUN (10: each run's length, payledger's
#   and the database's), POOL_SIZE (16), OUT (bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS="${1:-all}"
CONCURRENCIES="${CONCURRENCIES:-1 2 8 32 128}"
SECONDS_RUN="${SECONDS_RUN:-10}"
POOL_SIZE="${POOL_SIZE:-16}"
OUT="${OUT:-bench/results}"
COUNT=0 # set per run below (bench/lib.sh reads it)
SCENARIOS="pay keyed-pay transfer refund"
MEASURED="" # the backends this run measured, each drawn at the end
# shellcheck source=bench/lib.sh
. bench/lib.sh
mkdir -p "$OUT"

# Calls a run prepares for (orders, payments to refund): about what the fastest build seen here
# completes in SECONDS_RUN at that concurrency, with room to spare; the run stops at
# SECONDS_RUN whichever comes first.
calls_for() { # concurrency
  local per_second
  case $1 in
    1) per_second=1500 ;;
    2) per_second=2500 ;;
    *) per_second=5000 ;;
  esac
  echo $(( per_second * SECONDS_RUN ))
}

# One CSV row a run: backend,concurrency,series,calls_per_second,p50_ms,p99_ms
record() { echo "$1,$2,$3,$4,$5,$6" >> "$CSV"; }

report_field() { # label, python expression over `report`
  python3 -c "import json; report = json.load(open('$RESULTS/$1.json')); print($2)"
}

pgbench_point() { # clients
  local clients=$1 out
  if [ "$clients" -ge "$(psql -h "$PG_HOST" -U postgres -Atc 'SHOW max_connections')" ]; then
    echo "  pgbench at $clients clients: n/a (max_connections)"
    record postgres "$clients" database "" "" ""
    return
  fi
  out=$(pgbench -h "$PG_HOST" -U postgres -M prepared -b tpcb-like -c "$clients" -j "$(( clients < 2 ? 1 : 2 ))" \
    -T "$SECONDS_RUN" --log --log-prefix="$RESULTS/pgbench" pgbench_reference 2>/dev/null)
  local tps latency
  tps=$(echo "$out" | awk '/^tps = / {print $3; exit}')
  latency=$(echo "$out" | awk '/^latency average = / {print $4; exit}')
  # p50 and p99 from pgbench's per-transaction log (microseconds in its third column).
  read -r p50 p99 < <(cat "$RESULTS"/pgbench.* | python3 -c '
import sys
latencies = sorted(int(line.split()[2]) for line in sys.stdin if line.strip())
pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1000
print(f"{pick(0.5):.2f} {pick(0.99):.2f}")')
  rm -f "$RESULTS"/pgbench.*
  echo "  pgbench at $clients clients: $tps tps, average $latency ms, p50 $p50 ms, p99 $p99 ms"
  record postgres "$clients" database "$tps" "$p50" "$p99"
}

sysbench_point() { # threads
  local threads=$1 out
  out=$(sysbench oltp_write_only --db-driver=mysql --mysql-host=127.0.0.1 --mysql-user=root \
    --mysql-db=sysbench_reference --tables=8 --table-size=10000 --threads="$threads" --time="$SECONDS_RUN" \
    --percentile=50 --histogram=on run)
  local tps p50 p99
  tps=$(echo "$out" | awk '/transactions:/ {gsub(/\(/, "", $3); print $3; exit}')
  p50=$(echo "$out" | awk '/50th percentile:/ {print $3; exit}')
  # The histogram's rows are "value | bar count": the 99th percentile is read off it.
  p99=$(echo "$out" | python3 -c '
import re, sys
rows = [(float(m.group(1)), int(m.group(2))) for m in (re.match(r"\s*([0-9.]+)\s*\|[^0-9]*([0-9]+)\s*$", line) for line in sys.stdin) if m]
total, seen = sum(count for _, count in rows), 0
for value, count in rows:
    seen += count
    if seen >= 0.99 * total:
        print(f"{value:.2f}")
        break')
  echo "  sysbench at $threads threads: $tps tps, p50 $p50 ms, p99 $p99 ms"
  record mysql "$threads" database "$tps" "$p50" "$p99"
}

payledger_points() { # backend, database url, concurrency, database's tps
  local backend=$1 url=$2 concurrency=$3 reference=$4 scenario
  for scenario in $SCENARIOS; do
    COUNT=$(calls_for "$concurrency") bench "$scenario-$concurrency" "$scenario" "$concurrency" \
      --duration-seconds "$SECONDS_RUN"
    local rate p50 p99
    rate=$(report_field "$scenario-$concurrency" "report['calls_per_second']")
    p50=$(report_field "$scenario-$concurrency" "report['latency_us']['p50'] / 1000")
    p99=$(report_field "$scenario-$concurrency" "report['latency_us']['p99'] / 1000")
    record "$backend" "$concurrency" "$scenario" "$rate" "$p50" "$p99"
    if [ -n "$reference" ]; then echo "    $scenario / database: $(ratio "$rate" "$reference")"; fi
  done
}

curve() { # backend, database url, analyze command, the database's point function
  local backend=$1 url=$2 analyze=$3 point=$4 concurrency
  CSV="$OUT/curve-$backend.csv"
  echo "backend,concurrency,series,calls_per_second,p50_ms,p99_ms" > "$CSV"
  start_server "$url"
  # A warm-up round (not counted) writes payledger's tables, which are then analyzed, as the
  # databases' own benchmarks analyze theirs after loading them.
  COUNT=5000 bench warm-up pay 32
  $analyze
  for concurrency in $CONCURRENCIES; do
    echo "== $backend, $concurrency callers"
    $point "$concurrency"
    local reference
    reference=$(awk -F, -v c="$concurrency" '$2 == c && $3 == "database" {print $4}' "$CSV")
    payledger_points "$backend" "$url" "$concurrency" "$reference"
  done
  stop_server
  "$BIN" audit --database-url "$url"
  MEASURED="$MEASURED $backend"
}

if [ "$TARGETS" = all ] || [ "$TARGETS" = postgres ]; then
  need pgbench postgresql-contrib
  create_pg pgbench_reference
  pgbench -h "$PG_HOST" -U postgres -i -q -s 32 pgbench_reference >/dev/null 2>&1
  create_pg payledger_curve
  echo "== PostgreSQL ($(autovacuum_pg))"
  curve postgres "postgres://postgres@$PG_HOST:5432/payledger_curve" "analyze_pg payledger_curve" pgbench_point
fi

if [ "$TARGETS" = all ] || [ "$TARGETS" = mysql ]; then
  need sysbench sysbench
  create_my sysbench_reference
  sysbench oltp_write_only --db-driver=mysql --mysql-host=127.0.0.1 --mysql-user=root \
    --mysql-db=sysbench_reference --tables=8 --table-size=10000 prepare >/dev/null
  create_my payledger_curve
  echo "== MariaDB ($(autovacuum_my))"
  curve mysql "mysql://root@127.0.0.1:3306/payledger_curve" "analyze_my payledger_curve" sysbench_point
fi

# The pictures: each backend this run measured, from its CSV alone (bench/curve_plot.py), with
# matplotlib from a virtual environment made on first use.
VENV=target/bench-venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet matplotlib
fi
for backend in $MEASURED; do
  "$VENV/bin/python" bench/curve_plot.py "$OUT/curve-$backend.csv" "$OUT/curve-$backend.svg"
  echo "the curve: $OUT/curve-$backend.svg"
done
