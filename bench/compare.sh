#!/usr/bin/env bash
# Compares payledger's Pay with the database's own benchmark for the same transaction shape,
# in one run, on this machine, at the same concurrency:
#   PostgreSQL: pgbench tpcb-like (3 UPDATEs, a SELECT, an INSERT), prepared mode;
#   MariaDB/MySQL: sysbench oltp_write_only;
#   SQLite: payledger's pay figure alone (there is no server to compare with).
# Then every payledger scenario, the 128-caller overload, `pay` at half its peak rate, the
# server's peak resident memory and `payledger audit` on what the runs wrote. The database's
# benchmark runs before and after payledger and `pay` twice (the machine's speed drifts); the
# ratio compares means. payledger's tables are analyzed after its warm-up round has written
# them, as `pgbench -i` analyzes its own after loading them, and the database's autovacuum
# setting is printed with the results. Every database it creates is dropped again.
#
# With BASELINE_REV set (a git revision), or with the target `cost`, it also measures what this
# tree costs against that revision: each of COST_SCENARIOS (default "pay keyed-pay") of both
# builds on PostgreSQL, each on a fresh database, interleaved (baseline, this tree, baseline,
# this tree) at each of COST_CONCURRENCY (default "1 32"); the ratio compares the two runs'
# means. It measured the
# journal's hash chain against the revision before it (docs/benchmarks-history.md, "The hash
# chain's cost").
#
# Usage: bench/compare.sh [postgres|mysql|sqlite|cost|all]   (default: all)
# Environment: BASELINE_REV (none; required by `cost`), COST_CONCURRENCY ("1 32"), COST_SCENARIOS
#   ("pay keyed-pay"), CONCURRENCY (32), SECONDS_DB (20: length of the database's own run),
#   COUNT (calls per payledger scenario, 20000), POOL_SIZE (payledger's pool, 16),
#   PG_ADMIN (postgres://postgres@127.0.0.1:5432/postgres), MYSQL_ADMIN (mysql://root@127.0.0.1:3306/test).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS="${1:-all}"
CONCURRENCY="${CONCURRENCY:-32}"
SECONDS_DB="${SECONDS_DB:-20}"
COUNT="${COUNT:-20000}"
POOL_SIZE="${POOL_SIZE:-16}"
# shellcheck source=bench/lib.sh
. bench/lib.sh

# The machine is shared and its speed drifts by tens of percent within minutes, so the
# database's own benchmark runs twice, before and after payledger, and payledger's `pay` twice,
# first and last; the ratio compares the two means. A warm-up round (not counted) writes the
# tables, which are then analyzed, as pgbench's and sysbench's own preparation does.
payledger_suite() { # database url, reference label, reference function, target ratio, analyze command
  local url=$1 reference=$2 reference_run=$3 target=$4 analyze=$5
  local before after
  before=$($reference_run)
  echo "  $reference, before payledger: $before tps"
  start_server "$url"
  COUNT=$(( COUNT / 4 )) bench warm-up pay "$CONCURRENCY"
  $analyze
  bench pay pay "$CONCURRENCY"
  bench replay replay "$CONCURRENCY"
  bench hot hot "$CONCURRENCY"
  bench hot-zipf hot "$CONCURRENCY" --zipf 1.1
  bench refund refund "$CONCURRENCY"
  bench hot-refund hot-refund "$CONCURRENCY"
  bench keyed-pay keyed-pay "$CONCURRENCY"
  bench transfer transfer "$CONCURRENCY"
  bench deposit deposit "$CONCURRENCY"
  bench create-order create-order "$CONCURRENCY"
  bench query query "$CONCURRENCY"
  bench mixed mixed "$CONCURRENCY"
  bench pay-8 pay 8
  bench pay-128 pay 128
  bench pay-again pay "$CONCURRENCY"
  # Half the peak: of the mean of both `pay` runs (the first can run slow while the database
  # writes out what its own benchmark left dirty).
  local half
  half=$(python3 -c "print(round(($(rate pay) + $(rate pay-again)) / 4))")
  bench pay-half pay "$CONCURRENCY" --rate "$half"
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
  echo "  / $reference: keyed-pay $(ratio "$(rate keyed-pay)" "$reference_tps")   transfer $(ratio "$(rate transfer)" "$reference_tps")   deposit $(ratio "$(rate deposit)" "$reference_tps")   create-order $(ratio "$(rate create-order)" "$reference_tps")   refund $(ratio "$(rate refund)" "$reference_tps")   hot-refund $(ratio "$(rate hot-refund)" "$reference_tps") (issue targets: 1.0 on PostgreSQL, 0.8 on MariaDB)"
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
  echo "  statistics: $(autovacuum_pg)"
  payledger_suite "postgres://postgres@$PG_HOST:5432/payledger_bench" "pgbench tpcb-like" pgbench_run 1.3 \
    "analyze_pg payledger_bench"
fi

if [ "$TARGETS" = all ] || [ "$TARGETS" = mysql ]; then
  need sysbench sysbench
  echo "== MariaDB: sysbench oltp_write_only, $CONCURRENCY threads, ${SECONDS_DB}s; then payledger"
  create_my sysbench_reference
  $SB prepare >/dev/null
  create_my payledger_bench
  echo "  statistics: $(autovacuum_my)"
  payledger_suite "mysql://root@127.0.0.1:3306/payledger_bench" "sysbench oltp_write_only" sysbench_run 1.0 \
    "analyze_my payledger_bench"
fi

if [ "$TARGETS" = all ] || [ "$TARGETS" = sqlite ]; then
  echo "== SQLite (embedded): payledger"
  if [ -e /tmp/payledger_bench.db ]; then echo "/tmp/payledger_bench.db exists; not using it" >&2; exit 1; fi
  CREATED_SQLITE=/tmp/payledger_bench.db
  start_server "sqlite:/tmp/payledger_bench.db"
  COUNT=$(( COUNT / 4 )) bench warm-up pay "$CONCURRENCY"
  analyze_sqlite /tmp/payledger_bench.db
  bench pay pay "$CONCURRENCY"
  stop_server
  "$BIN" audit --database-url "sqlite:/tmp/payledger_bench.db"
  echo "  server peak resident memory: $(( $(cat "$RESULTS/rss_kb") / 1024 )) MB"
fi

if [ "$TARGETS" = cost ] || [ -n "${BASELINE_REV:-}" ]; then
  : "${BASELINE_REV:?the target cost needs BASELINE_REV, the revision to compare this tree with}"
  BASELINE_DIR="$(mktemp -d)/payledger-baseline"
  git worktree add --quiet --detach "$BASELINE_DIR" "$BASELINE_REV"
  trap 'cleanup; git worktree remove --force "$BASELINE_DIR"' EXIT
  echo "== The cost of this tree ($(git rev-parse --short HEAD)) against $BASELINE_REV on PostgreSQL: ${COST_SCENARIOS:-pay keyed-pay}, interleaved"
  # The dependencies built for this tree, copied: only the workspace's own crates are built again.
  mkdir -p "$BASELINE_DIR/target" && cp -r target/release "$BASELINE_DIR/target/"
  (cd "$BASELINE_DIR" && CARGO_TARGET_DIR="$BASELINE_DIR/target" cargo build --release --locked --quiet -p payledger)
  THIS_BIN=$BIN
  for callers in ${COST_CONCURRENCY:-1 32}; do
    for round in 1 2; do
      for side in baseline this; do
        if [ "$side" = baseline ]; then BIN="$BASELINE_DIR/target/release/payledger"; else BIN=$THIS_BIN; fi
        db="payledger_cost_${side}_${callers}_${round}"
        create_pg "$db"
        echo "  $side, $callers caller(s), round $round:"
        start_server "postgres://postgres@$PG_HOST:5432/$db"
        COUNT=$(( COUNT / 4 )) bench "warm-$side-$callers-$round" pay "$callers"
        analyze_pg "$db"
        for scenario in ${COST_SCENARIOS:-pay keyed-pay}; do
          bench "$scenario-$side-$callers-$round" "$scenario" "$callers"
        done
        stop_server
        drop_pg "$db"
      done
    done
    for scenario in ${COST_SCENARIOS:-pay keyed-pay}; do
      base=$(mean "$(rate "$scenario-baseline-$callers-1")" "$(rate "$scenario-baseline-$callers-2")")
      this=$(mean "$(rate "$scenario-this-$callers-1")" "$(rate "$scenario-this-$callers-2")")
      echo "  $scenario at $callers caller(s): $BASELINE_REV $base calls/s, this tree $this calls/s (means of 2), ratio $(ratio "$this" "$base")"
    done
  done
  BIN=$THIS_BIN
fi
