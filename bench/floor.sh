#!/usr/bin/env bash
# What a Pay costs PostgreSQL itself, side by side with pgbench tpcb-like and payledger's `pay`:
# the lowest rate any server could reach with payledger's tables, whatever it does above them.
# At each concurrency, in one run on this machine, each for SECONDS_RUN:
#   database      pgbench -M prepared -b tpcb-like (scale 32), the curve's reference;
#   as-sent       a Pay's statements as a locked batch of one sends them (bench/floor/as-sent.sql);
#   as-sent-unlocked  as a batch of one without row locks sends them, payledger's shape at 1
#                 caller (as-sent-unlocked.sql: three reads, then the write that commits itself);
#   minimal       the fewest statements a Pay's rows need, in a transaction (minimal.sql);
#   two-round-trips  a read without locks, then the as-sent write as one statement that commits
#                 itself (two-round-trips.sql): what an optimistic write path could cost;
#   one-statement every row of a Pay in one statement, one round trip (one-statement.sql);
#   pay           payledger's `pay` scenario through a release server (gRPC, 1 call = 1 Pay).
#   health        `grpc.health.v1.Health/Check` of the same server (the `health` scenario): a
#                 gRPC round trip through its transport and observation with no ledger work and
#                 no statement, what any call costs before a Pay's own work.
# The floor scripts run through pgbench on the server's own database (their own orders and
# accounts, seeded by seed.sql) with the server's session settings (generic plans). Prints
# each rate and its ratio to tpcb-like, and writes $OUT/floor-postgres.csv.
#
# Usage: bench/floor.sh
# Environment: CONCURRENCIES ("1 2 8 32"), SECONDS_RUN (8), ORDERS (400000: PENDING orders
#   seeded for the floor scripts, enough for every run), POOL_SIZE (16), OUT (bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."

CONCURRENCIES="${CONCURRENCIES:-1 2 8 32}"
SECONDS_RUN="${SECONDS_RUN:-8}"
ORDERS="${ORDERS:-400000}"
POOL_SIZE="${POOL_SIZE:-16}"
OUT="${OUT:-bench/results}"
COUNT=0
# shellcheck source=bench/lib.sh
. bench/lib.sh
mkdir -p "$OUT"
need pgbench postgresql-contrib

CSV="$OUT/floor-postgres.csv"
echo "concurrency,series,per_second,latency_ms" > "$CSV"

# pgbench vacuums its own tables before a tpcb-like run, as bench/curve.sh lets it (with
# autovacuum off, its 32 branch rows would otherwise carry every earlier run's dead versions);
# the floor scripts run with -n on payledger's tables, which no one vacuums, as in production
# between autovacuum's visits.
pgbench_run() { # series, clients, pgbench arguments...
  local series=$1 clients=$2 out tps latency
  shift 2
  out=$(pgbench -h "$PG_HOST" -U postgres -M prepared -c "$clients" -j "$(( clients < 2 ? 1 : 2 ))" \
    -T "$SECONDS_RUN" "$@" 2>&1) || { echo "$out" >&2; return 1; }
  tps=$(echo "$out" | awk '/^tps = / {print $3; exit}')
  latency=$(echo "$out" | awk '/^latency average = / {print $4; exit}')
  printf '  %-14s %9.1f /s   average %6.2f ms\n' "$series" "$tps" "$latency"
  echo "$clients,$series,$tps,$latency" >> "$CSV"
}

create_pg pgbench_reference
pgbench -h "$PG_HOST" -U postgres -i -q -s 32 pgbench_reference >/dev/null 2>&1
create_pg payledger_floor
FLOOR_URL="postgres://postgres@$PG_HOST:5432/payledger_floor"
start_server "$FLOOR_URL"
COUNT=5000 bench warm-up pay 32
psql -h "$PG_HOST" -U postgres -d payledger_floor -q -v n="$ORDERS" -f bench/floor/seed.sql
analyze_pg payledger_floor

for clients in $CONCURRENCIES; do
  echo "== $clients clients"
  pgbench_run database "$clients" -b tpcb-like pgbench_reference
  for script in as-sent as-sent-unlocked minimal two-round-trips one-statement; do
    # With the server's session setting: each statement planned once and kept (src/store/dialect.rs).
    PGOPTIONS="-c plan_cache_mode=force_generic_plan" \
      pgbench_run "$script" "$clients" -n -f "bench/floor/$script.sql" payledger_floor
  done
  COUNT=$(( 5000 * SECONDS_RUN )) bench "pay-$clients" pay "$clients" --duration-seconds "$SECONDS_RUN"
  echo "$clients,pay,$(rate "pay-$clients"),$(python3 -c "import json; print(json.load(open('$RESULTS/pay-$clients.json'))['latency_us']['mean'] / 1000)")" >> "$CSV"
  COUNT=$(( 40000 * SECONDS_RUN )) bench "health-$clients" health "$clients" --duration-seconds "$SECONDS_RUN"
  echo "$clients,health,$(rate "health-$clients"),$(python3 -c "import json; print(json.load(open('$RESULTS/health-$clients.json'))['latency_us']['mean'] / 1000)")" >> "$CSV"
  python3 - "$CSV" "$clients" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["concurrency"] == sys.argv[2]]
reference = float(next(r["per_second"] for r in rows if r["series"] == "database"))
print("  against tpcb-like: " + ", ".join(
    f"{r['series']} {float(r['per_second']) / reference:.2f}x" for r in rows if r["series"] != "database"))
PY
done
stop_server
psql -h "$PG_HOST" -U postgres -d payledger_floor -Atc \
  "SELECT 'floor orders paid: ' || count(*) FILTER (WHERE status = 'PAID') || ' of ' || count(*) FROM orders WHERE merchant_id LIKE 'fm%'"
echo "figures: $CSV"
