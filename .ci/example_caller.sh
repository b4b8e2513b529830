#!/usr/bin/env bash
# Builds the example calling service, starts `payledger serve` on a free loopback port over a
# temporary SQLite database, runs the example against it, and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --quiet --bin payledger --bin checkout-service
work=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
target/debug/payledger serve --listen "127.0.0.1:$port" --database-url "sqlite:$work/ledger.db" >"$work/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
  sleep 0.1
done
if ! target/debug/checkout-service "http://127.0.0.1:$port"; then
  echo "the example caller failed; server log:" >&2
  cat "$work/server.log" >&2
  exit 1
fi
echo "example caller: paid once, the retry was answered as a replay"
