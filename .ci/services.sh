#!/usr/bin/env bash
# Starts PostgreSQL, MariaDB and Redis when they are not already answering, and waits for
# them. The start commands are those of this machine's image (Debian packages).
set -euo pipefail

wait_for() { # name, command...
  local name=$1; shift
  for _ in $(seq 1 60); do
    if "$@" >/dev/null 2>&1; then echo "$name is up"; return 0; fi
    sleep 1
  done
  echo "$name did not come up" >&2
  return 1
}

# The Galera cluster of bench/galera.sh: the provider and rsync (its state transfer), from
# Debian's packages, installed when missing.
if [ ! -f /usr/lib/galera/libgalera_smm.so ] || ! command -v rsync >/dev/null 2>&1; then
  echo "installing galera-4 and rsync"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq galera-4 rsync
fi

# Prometheus and promtool, for the check of deploy/'s rules and dashboard
# (.ci/prometheus_check.py): Debian's prometheus package, without its recommended exporters.
# Its service is not started (the check runs a Prometheus of its own).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "installing prometheus"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi

if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
fi
wait_for PostgreSQL pg_isready -h 127.0.0.1 -p 5432

if ! mariadb -uroot -h127.0.0.1 -e 'SELECT 1' >/dev/null 2>&1; then
  echo "starting MariaDB"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
fi
wait_for MariaDB mariadb -uroot -h127.0.0.1 -e 'SELECT 1'

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
wait_for Redis redis-cli -h 127.0.0.1 -p 6379 ping
