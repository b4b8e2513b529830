#!/usr/bin/env bash
# schemathesis (PyPI), the property-based API fuzzer, driven by the OpenAPI document a real
# `payledger serve` serves at /v1/openapi.json, on every backend (SQLite, PostgreSQL,
# MySQL/MariaDB) in turn: its coverage, fuzzing and stateful phases, every check but
# positive_data_acceptance (see docs/http.md, "The OpenAPI document"). Each run must find no
# failure and no error (no 5xx, no schema or status mismatch, no schema-violating request
# accepted), and `payledger audit` must pass on the database afterwards. The venv is kept in
# target/ between runs. EXAMPLES (default 100) bounds the cases generated per operation. One
# worker: with two, hypothesis (under schemathesis 4.32.5 on CPython 3.11) at times fails on its
# own (a "Runtime Error", "AST constructor recursion depth mismatch"), never on a server answer.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh
venv=target/schemathesis-venv
python_venv "$venv" .ci/schemathesis/requirements.txt
cargo build --locked --quiet --bin payledger
examples="${EXAMPLES:-100}"
work=$(mktemp -d)
server=""
stop() { [ -n "$server" ] && { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }; server=""; }
cleanup() {
  stop
  psql -q "${PAYLEDGER_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}" -c "DROP DATABASE IF EXISTS payledger_schemathesis WITH (FORCE)" >/dev/null 2>&1 || true
  mariadb -h 127.0.0.1 -u root -e "DROP DATABASE IF EXISTS payledger_schemathesis" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

fuzz() { # backend, database URL
  local backend=$1 url=$2 port cases
  port=$(free_port)
  target/debug/payledger serve --listen "127.0.0.1:$port" --database-url "$url" >"$work/$backend-server.log" 2>&1 &
  server=$!
  wait_for_port "$port" 200 || true
  # From the temporary directory: schemathesis keeps its cache (.schemathesis/) where it runs.
  if ! (cd "$work" && "$OLDPWD/$venv/bin/schemathesis" run "http://127.0.0.1:$port/v1/openapi.json" \
      --url "http://127.0.0.1:$port" --max-examples "$examples" --workers 1 --no-color \
      --exclude-checks positive_data_acceptance) >"$work/$backend.out" 2>&1; then
    echo "schemathesis found failures on $backend:" >&2
    cat "$work/$backend.out" >&2
    tail -n 50 "$work/$backend-server.log" >&2
    exit 1
  fi
  stop
  if grep -q '"level":"ERROR"\| ERROR ' "$work/$backend-server.log"; then
    echo "the server logged an error under schemathesis on $backend:" >&2
    grep '"level":"ERROR"\| ERROR ' "$work/$backend-server.log" >&2
    exit 1
  fi
  target/debug/payledger audit --database-url "$url" >"$work/$backend-audit.out" 2>&1 || {
    echo "the audit failed after schemathesis on $backend:" >&2; cat "$work/$backend-audit.out" >&2; exit 1; }
  cases=$(grep -A1 '^Test cases:' "$work/$backend.out" | tail -n 1 | sed 's/^ *//')
  echo "schemathesis on $backend: $cases (calls to the server), no failure; the audit passes"
}

fuzz sqlite "sqlite:$work/ledger.db"
pg_admin="${PAYLEDGER_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
psql -q "$pg_admin" -c "DROP DATABASE IF EXISTS payledger_schemathesis WITH (FORCE)" -c "CREATE DATABASE payledger_schemathesis"
fuzz postgres "${pg_admin%/*}/payledger_schemathesis"
mariadb -h 127.0.0.1 -u root -e "DROP DATABASE IF EXISTS payledger_schemathesis; CREATE DATABASE payledger_schemathesis"
my_admin="${PAYLEDGER_TEST_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
fuzz mysql "${my_admin%/*}/payledger_schemathesis"
