#!/usr/bin/env bash
# The storm through a 3-node Galera cluster (bench/galera.sh, already started): three
# payledger instances, one per node, the usual faults, and node 3 killed (SIGKILL) 12 s in and
# rejoined 8 s later. The storm checks exactly-once from its log of acknowledged calls, counts
# any INTERNAL as a violation, and runs the audit against every node; it exits 1 on any
# violation.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION_SECONDS=${GALERA_STORM_SECONDS:-40}
database=payledger_galera_storm
args=()
while read -r url; do args+=(--database-url "${url%/*}/$database"); done < <(bash bench/galera.sh urls)

cargo build --locked --quiet -p payledger-tools
target/debug/payledger-tools storm "${args[@]}" --instances 3 --callers 16 \
  --duration-seconds "$DURATION_SECONDS" &
storm=$!
sleep 12
bash bench/galera.sh kill 3
sleep 8
bash bench/galera.sh rejoin 3
wait "$storm"
bash bench/galera.sh status
