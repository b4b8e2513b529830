#!/usr/bin/env bash
# The client crate must stay affordable for callers: no database driver, no SQLite, no Redis,
# no sqlx and no server code in its normal dependency tree, and tonic without its server
# features. Fails listing what crept in.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(cargo tree --locked -p payledger-client -e normal --prefix none)
forbidden=$(grep -E '^(sqlx|sqlx-[a-z-]+|libsqlite3-sys|rusqlite|mysql[a-z_-]*|postgres[a-z_-]*|tokio-postgres|redis|axum|tonic-health|tonic-reflection|payledger) ' <<<"$tree" | sort -u || true)
server_features=$(cargo tree --locked -p payledger-client -e features -i tonic --prefix none \
  | grep -E 'tonic feature "(server|router|transport)"' | sort -u || true)
if [ -n "$forbidden$server_features" ]; then
  echo "payledger-client pulls in what a caller must not compile:"
  printf '%s\n' "$forbidden" "$server_features" | sed '/^$/d; s/^/  /'
  exit 1
fi
echo "payledger-client: $(sed 's/ (\*)//' <<<"$tree" | sort -u | wc -l) crates, none of them a database driver, Redis or server code"
