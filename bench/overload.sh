#!/usr/bin/env bash
# Overload, measured side by side in one run on one PostgreSQL database:
#   1. peak: `payledger-tools bench --scenario pay` closed loop at 32 callers;
#   2. overload: the same scenario open loop at 4x that peak for 20 s, with up to 1,536 calls
#      in flight against the server's defaults (--max-concurrent-calls 512,
#      --pay-queue-max 1024).
# It prints the server's resident memory (sampled every 0.2 s), the status codes, goodput as
# a ratio of the peak, and checks: every refused call is RESOURCE_EXHAUSTED, every accepted
# Pay wrote exactly one payment (rows = OK answers of both runs, which send fresh
# out_trade_nos and no retries), and `payledger audit` passes.
#
# Usage: bench/overload.sh [admin-postgres-url]   (default postgres://postgres@127.0.0.1:5432/postgres)
# Needs release binaries: cargo build --release -p payledger -p payledger-tools
set -euo pipefail
cd "$(dirname "$0")/.."
admin_url="${1:-postgres://postgres@127.0.0.1:5432/postgres}"
database="payledger_overload_$$"
url="${admin_url%/*}/$database"
server_bin=target/release/payledger
bench_bin=target/release/payledger-tools
for binary in "$server_bin" "$bench_bin"; do
  [ -x "$binary" ] || { echo "missing $binary: cargo build --release -p payledger -p payledger-tools" >&2; exit 2; }
done
work=$(mktemp -d)
server=""
cleanup() {
  [ -n "$server" ] && { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
  psql -q "$admin_url" -c "DROP DATABASE IF EXISTS $database" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
psql -q "$admin_url" -c "CREATE DATABASE $database" >/dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$server_bin" serve --listen "127.0.0.1:$port" --database-url "$url" \
  --log-filter "warn,payledger::access=off" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 100); do
  if "$server_bin" health --target "http://127.0.0.1:$port" >/dev/null 2>&1; then break; fi
  sleep 0.1
done
rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$server/status"; }
target="http://127.0.0.1:$port"

echo "== peak: closed loop, 32 callers"
"$bench_bin" bench --target "$target" --allow-test-data --scenario pay -c 32 -n 20000 --json \
  | tee "$work/peak.txt"
rss_before=$(rss_kib)
peak=$(python3 -c 'import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith("bench-report: ")][0][14:]); print(r["status_codes"].get("Ok",0)/r["duration_seconds"])' "$work/peak.txt")
rate=$(python3 -c "print(round(4 * $peak))")
total=$((rate * 20))

echo "== overload: open loop at $rate calls/s (4 x $peak), 20 s, up to 1536 in flight"
( while kill -0 "$server" 2>/dev/null; do rss_kib >>"$work/rss.txt"; sleep 0.2; done ) &
sampler=$!
"$bench_bin" bench --target "$target" --allow-test-data --scenario pay -c 1536 --connections 16 \
  -n "$total" --rate "$rate" --duration-seconds 20 --json | tee "$work/overload.txt" || true
# (bench exits 1 when any call was refused; the checks below decide which refusals are right)
kill "$sampler" 2>/dev/null || true

echo "== checks"
payments=$(psql -qtA "$url" -c "SELECT COUNT(*) FROM payment_flow")
python3 - "$work" "$peak" "$payments" "$rss_before" <<'EOF'
import json, sys
work, peak, payments, rss_before = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def report(name):
    line = [l for l in open(f"{work}/{name}.txt") if l.startswith("bench-report: ")][0]
    return json.loads(line[len("bench-report: "):])
peak_run, overload = report("peak"), report("overload")
codes = overload["status_codes"]
ok = codes.get("Ok", 0)
goodput = ok / overload["duration_seconds"]
rss = [int(x) for x in open(f"{work}/rss.txt").read().split()]
print(f"peak {peak:.0f} calls/s; offered {overload['offered_rate']:.0f}/s; goodput {goodput:.0f}/s = {goodput / peak:.2f} x peak")
print(f"overload status codes: {codes}; p50 {overload['latency_us']['p50'] / 1000:.1f} ms, p99 {overload['latency_us']['p99'] / 1000:.1f} ms (from scheduled start)")
print(f"server RSS: {rss_before / 1024:.0f} MiB before, max {max(rss) / 1024:.0f} MiB during the overload")
failures = []
if set(codes) - {"Ok", "ResourceExhausted"}:
    failures.append(f"refusals other than RESOURCE_EXHAUSTED: {codes}")
if goodput < 0.8 * peak:
    failures.append(f"goodput {goodput:.0f}/s is under 0.8 x peak {peak:.0f}/s")
accepted = peak_run["status_codes"].get("Ok", 0) + ok
if payments != accepted:
    failures.append(f"{payments} payments for {accepted} accepted Pays")
else:
    print(f"exactly once: {payments} payments = {accepted} accepted Pays; refused Pays wrote nothing")
for failure in failures:
    print("FAIL:", failure)
sys.exit(1 if failures else 0)
EOF
"$server_bin" audit --database-url "$url"
