#!/usr/bin/env bash
# The trust boundary as an independent caller sees it: Python grpcio (PyPI) against a real
# `payledger serve` with mutual TLS and JWT authentication, with stubs generated from the
# .proto and certificates made for the run. The venv is kept in target/ between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh
venv=target/contract-venv
python_venv "$venv" .ci/contract/requirements.txt
cargo build --locked --quiet --bin payledger
work=$(mktemp -d)
server=""
trap '[ -n "$server" ] && { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }; rm -rf "$work"' EXIT
"$venv/bin/python" -m grpc_tools.protoc -I proto --python_out="$work" --grpc_python_out="$work" \
  proto/payledger/v1/payledger.proto
cp "$work/payledger/v1/payledger_pb2.py" "$work/payledger/v1/payledger_pb2_grpc.py" "$work/"
sed -i 's/^from payledger.v1 import payledger_pb2/import payledger_pb2/' "$work/payledger_pb2_grpc.py"
"$venv/bin/python" .ci/contract/make_certs.py "$work"
target/debug/payledger auth keygen --dir "$work/auth" >/dev/null
port=$(free_port)
target/debug/payledger serve --listen "127.0.0.1:$port" --database-url "sqlite:$work/ledger.db" \
  --tls-cert "$work/server.pem" --tls-key "$work/server-key.pem" --tls-client-ca "$work/ca.pem" \
  --auth-jwks "$work/auth/jwks.json" --auth-issuer payledger-dev --auth-audience payledger --auth-leeway-seconds 0 \
  >"$work/server.log" 2>&1 &
server=$!
wait_for_port "$port" || true
# GRPC_VERBOSITY=NONE: gRPC C-core would print the refused mTLS handshake the check provokes.
if ! GRPC_VERBOSITY=NONE PYTHONPATH="$work" "$venv/bin/python" .ci/contract/auth_contract.py "127.0.0.1:$port" "$work" \
  target/debug/payledger "$work/auth/jwt-signing-key.pem"; then
  echo "the Python contract check failed; server log:" >&2
  cat "$work/server.log" >&2
  exit 1
fi
# Connections that move (gRFC A9): a server of its own whose connections get a GOAWAY after
# 1 s, called by grpcio until it has moved twice, every call answered.
age_port=$(free_port)
target/debug/payledger serve --listen "127.0.0.1:$age_port" --database-url "sqlite:$work/age.db" \
  --max-connection-age-seconds 1 >"$work/age.log" 2>&1 &
age_server=$!
for _ in $(seq 1 100); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$age_port") 2>/dev/null; then break; fi
  sleep 0.1
done
if ! PYTHONPATH="$work" "$venv/bin/python" .ci/contract/connection_age.py "127.0.0.1:$age_port"; then
  echo "the connection-age check failed; server log:" >&2
  cat "$work/age.log" >&2
  kill "$age_server" 2>/dev/null || true
  exit 1
fi
kill "$age_server" 2>/dev/null || true
wait "$age_server" 2>/dev/null || true
# The example caller (examples/checkout-service) through the same boundary: the server's CA,
# a client certificate and a token of its own, passed the way its README says.
cargo build --locked --quiet --bin checkout-service
token=$(target/debug/payledger auth mint --key "$work/auth/jwt-signing-key.pem" --sub checkout --merchants checkout \
  --scope "payments:write payments:read accounts:write accounts:read accounts:admin")
if ! PAYLEDGER_TOKEN="$token" target/debug/checkout-service "https://localhost:$port" --tls-ca "$work/ca.pem" \
  --tls-cert "$work/client.pem" --tls-key "$work/client-key.pem"; then
  echo "the example caller failed over mutual TLS with a token; server log:" >&2
  cat "$work/server.log" >&2
  exit 1
fi
grep -q 'authentication="jwt" transport="mtls"' "$work/server.log" || { echo "start-up line:" >&2; cat "$work/server.log" >&2; exit 1; }
# No token reaches the log: a JWT's header and claims both start with `eyJ` ('{"').
if grep -Eq 'eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.' "$work/server.log"; then
  echo "the server log holds a JWT" >&2
  exit 1
fi
