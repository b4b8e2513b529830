#!/usr/bin/env bash
# README.md's curl recipe ("Over HTTP/JSON, with curl"), exactly as written there, against a
# real `payledger serve` on a fresh SQLite ledger, three times: over HTTP/1.1, over HTTP/2
# cleartext (curl's http2-prior-knowledge) and over TLS (HTTP/2 by ALPN, a certificate made
# for the run), then over mutual TLS (a client certificate from a CA made for the run; a
# connection without one is refused). The transport is chosen by a .curlrc (CURL_HOME) and
# BASE, so the block runs unchanged. Each run must succeed, replay the Pay, and have used the
# intended protocol.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh
cargo build --locked --quiet --bin payledger
work=$(mktemp -d)
server=""
stop() { [ -n "$server" ] && { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }; server=""; }
trap 'stop; rm -rf "$work"' EXIT

# The recipe: the first sh block after the section's heading.
awk '/^## Over HTTP\/JSON, with curl/ {section = 1} section && /^```sh/ {block = 1; next}
     block && /^```/ {exit} block {print}' README.md > "$work/recipe.sh"
grep -q ':pay' "$work/recipe.sh" || { echo "README.md has no curl recipe to run" >&2; exit 1; }

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost \
  -addext basicConstraints=critical,CA:FALSE \
  -keyout "$work/server-key.pem" -out "$work/server.pem" 2>/dev/null

# Mutual TLS: a CA, and a client certificate it signed.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=payledger-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign \
  -keyout "$work/ca-key.pem" -out "$work/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=back-office \
  -keyout "$work/client-key.pem" -out "$work/client.csr" 2>/dev/null
printf 'basicConstraints=critical,CA:FALSE\nextendedKeyUsage=clientAuth\n' > "$work/client.ext"
openssl x509 -req -in "$work/client.csr" -CA "$work/ca.pem" -CAkey "$work/ca-key.pem" -CAcreateserial -days 2 \
  -extfile "$work/client.ext" -out "$work/client.pem" 2>/dev/null

run() { # name, protocol expected in the answers' status lines, curlrc lines...
  local name=$1 protocol=$2 port scheme=http tls=()
  shift 2
  mkdir -p "$work/$name"
  printf '%s\n' "$@" > "$work/$name/.curlrc"
  if grep -q cacert "$work/$name/.curlrc"; then
    scheme=https
    tls=(--tls-cert "$work/server.pem" --tls-key "$work/server-key.pem")
  fi
  if grep -q '^cert' "$work/$name/.curlrc"; then
    tls+=(--tls-client-ca "$work/ca.pem")
  fi
  port=$(free_port)
  target/debug/payledger serve --listen "127.0.0.1:$port" --database-url "sqlite:$work/$name/ledger.db" "${tls[@]}" \
    >"$work/$name/server.log" 2>&1 &
  server=$!
  wait_for_port "$port" || true
  if [ ${#tls[@]} -gt 4 ] && curl -sS -o /dev/null --cacert "$work/server.pem" "https://localhost:$port/v1/accounts/alice" 2>/dev/null; then
    echo "$name: a connection without a client certificate was served" >&2
    exit 1
  fi
  if ! CURL_HOME="$work/$name" BASE="$scheme://localhost:$port" bash -euo pipefail "$work/recipe.sh" > "$work/$name/out" 2>&1; then
    echo "the README's curl recipe failed over $name:" >&2
    cat "$work/$name/out" "$work/$name/server.log" >&2
    exit 1
  fi
  stop
  grep -q '^idempotent-replayed: true' "$work/$name/out" || { echo "$name: the second Pay was not a replay" >&2; cat "$work/$name/out" >&2; exit 1; }
  grep -q "$protocol 200" "$work/$name/out" || { echo "$name: no $protocol answer" >&2; cat "$work/$name/out" >&2; exit 1; }
  grep -q '"status":"ORDER_STATUS_PARTIALLY_REFUNDED"' "$work/$name/out" || { echo "$name: the query does not show the refund" >&2; exit 1; }
  echo "the README's curl recipe over $name: Pays answered $protocol, the second replayed; refund and query as documented"
}

run "HTTP/1.1" "HTTP/1.1" "http1.1"
run "HTTP/2 cleartext" "HTTP/2" "http2-prior-knowledge"
run "TLS" "HTTP/2" "cacert = $work/server.pem"
run "mutual TLS, HTTP/1.1" "HTTP/1.1" "cacert = $work/server.pem" "cert = $work/client.pem" "key = $work/client-key.pem" "http1.1"
