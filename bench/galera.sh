#!/usr/bin/env bash
# A 3-node MariaDB Galera cluster on loopback, from Debian's packages (mariadb-server,
# galera-4, rsync), for payledger's cluster test. Each node runs as the `mysql` user with a
# data directory of its own under $GALERA_DIR; state transfer (SST) is rsync.
#
#   bench/galera.sh start        bootstrap node 1, join nodes 2 and 3, create database `test`
#   bench/galera.sh kill N       SIGKILL node N (1-3): the others keep quorum (2 of 3)
#   bench/galera.sh rejoin N     start node N again; it rejoins by IST or SST and is Synced
#   bench/galera.sh status       each node's wsrep_local_state_comment and cluster size
#   bench/galera.sh urls         the three mysql:// URLs, one per line
#   bench/galera.sh stop         stop every node and remove $GALERA_DIR (its data too)
#
# `start` first stops and removes a cluster already in $GALERA_DIR. Every command takes the
# same GALERA_DIR (default /tmp/payledger-galera) and GALERA_PORT_BASE (default 13306): export
# them for a cluster of your own, and for the scripts that call this one.
#
# Ports: SQL on $GALERA_PORT_BASE+N (default 13307..13309), group communication on
# $GALERA_PORT_BASE+1251+10N (14567, 14577, 14587), IST one above it, SST (rsync) two above.
# Another cluster can run beside it with another GALERA_DIR and GALERA_PORT_BASE. Root has no
# password and no network access beyond loopback. Needs root (it runs the nodes as `mysql`).
set -euo pipefail

GALERA_DIR=${GALERA_DIR:-/tmp/payledger-galera}
GALERA_PORT_BASE=${GALERA_PORT_BASE:-13306}
NODES=3
# How long a node may take to reach Synced (an SST of a small database takes seconds).
SYNC_WAIT_SECONDS=${GALERA_SYNC_WAIT_SECONDS:-120}

provider() {
  for candidate in /usr/lib/galera/libgalera_smm.so /usr/lib/libgalera_smm.so /usr/lib64/galera-4/libgalera_smm.so; do
    if [ -f "$candidate" ]; then echo "$candidate"; return 0; fi
  done
  echo "galera.sh: no Galera provider (install Debian's galera-4)" >&2
  return 1
}

sql_port() { echo $((GALERA_PORT_BASE + $1)); }
gcomm_port() { echo $((GALERA_PORT_BASE + 1251 + 10 * $1)); }
node_dir() { echo "$GALERA_DIR/node$1"; }
socket() { echo "$(node_dir "$1")/mysqld.sock"; }
pidfile() { echo "$(node_dir "$1")/mysqld.pid"; }

cluster_address() {
  local peers=() n
  for n in $(seq 1 $NODES); do peers+=("127.0.0.1:$(gcomm_port "$n")"); done
  local IFS=,
  echo "gcomm://${peers[*]}"
}

client() { # node, mariadb arguments...
  local n=$1; shift
  mariadb --no-defaults --protocol=socket --socket="$(socket "$n")" -uroot "$@"
}

write_config() {
  local n=$1 dir gcomm
  dir=$(node_dir "$n"); gcomm=$(gcomm_port "$n")
  cat >"$dir/my.cnf" <<EOF
[mariadbd]
datadir=$dir/data
socket=$(socket "$n")
pid-file=$(pidfile "$n")
log-error=$dir/error.log
port=$(sql_port "$n")
bind-address=127.0.0.1
user=mysql
skip-name-resolve
innodb_buffer_pool_size=64M
innodb_log_file_size=48M
innodb_flush_log_at_trx_commit=2
max_connections=300
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
wsrep_on=ON
wsrep_provider=$(provider)
wsrep_cluster_name=payledger-test
wsrep_cluster_address=$(cluster_address)
wsrep_node_name=node$n
wsrep_node_address=127.0.0.1:$gcomm
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:$((gcomm + 2))
# repl.causal_read_timeout bounds payledger's causal wait: the default --lock-timeout-ms.
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$gcomm;ist.recv_addr=127.0.0.1:$((gcomm + 1));gcache.size=64M;pc.wait_prim_timeout=PT30S;repl.causal_read_timeout=PT5S"
wsrep_slave_threads=2
EOF
}

start_node() { # node, extra mariadbd arguments...
  local n=$1; shift
  local dir; dir=$(node_dir "$n")
  if [ ! -d "$dir/data/mysql" ]; then
    mkdir -p "$dir/data"
    write_config "$n"
    chown -R mysql:mysql "$dir"
    mariadb-install-db --defaults-file="$dir/my.cnf" --user=mysql \
      --auth-root-authentication-method=normal --skip-test-db >"$dir/install.log" 2>&1
  fi
  # The SST scripts (wsrep_sst_rsync) are found on PATH.
  PATH="/usr/bin:/usr/sbin:$PATH" setsid /usr/sbin/mariadbd --defaults-file="$dir/my.cnf" "$@" \
    >>"$dir/stdout.log" 2>&1 </dev/null &
  wait_synced "$n"
}

state() { client "$1" -N -B -e "SHOW GLOBAL STATUS LIKE 'wsrep_local_state_comment'" 2>/dev/null | cut -f2; }

wait_synced() {
  local n=$1 i
  for i in $(seq 1 "$SYNC_WAIT_SECONDS"); do
    if [ "$(state "$n")" = "Synced" ]; then echo "node $n Synced (port $(sql_port "$n"))"; return 0; fi
    sleep 1
  done
  echo "galera.sh: node $n did not reach Synced in ${SYNC_WAIT_SECONDS} s; $(node_dir "$n")/error.log:" >&2
  tail -n 30 "$(node_dir "$n")/error.log" >&2 || true
  return 1
}

node_pid() { cat "$(pidfile "$1")" 2>/dev/null || true; }

kill_node() {
  local n=$1 pid; pid=$(node_pid "$n")
  if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  for _ in $(seq 1 50); do
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  rm -f "$(pidfile "$n")"
  echo "node $n killed"
}

stop_all() {
  local n pid
  for n in $(seq 1 $NODES); do
    pid=$(node_pid "$n")
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for n in $(seq 1 $NODES); do
    pid=$(node_pid "$n")
    for _ in $(seq 1 300); do
      if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then break; fi
      sleep 0.1
    done
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  rm -rf "$GALERA_DIR"
}

case "${1:-}" in
  start)
    if [ -d "$GALERA_DIR" ]; then stop_all; fi
    mkdir -p "$GALERA_DIR"; chown mysql:mysql "$GALERA_DIR"
    start_node 1 --wsrep-new-cluster
    client 1 -e "CREATE DATABASE IF NOT EXISTS test"
    start_node 2
    start_node 3
    ;;
  kill) kill_node "${2:?node number}" ;;
  rejoin) start_node "${2:?node number}" ;;
  status)
    for n in $(seq 1 $NODES); do
      size=$(client "$n" -N -B -e "SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'" 2>/dev/null | cut -f2 || true)
      state=$(state "$n" || true)
      echo "node $n port $(sql_port "$n"): ${size:+cluster size $size, }${state:-down}"
    done
    ;;
  urls) for n in $(seq 1 $NODES); do echo "mysql://root@127.0.0.1:$(sql_port "$n")/test"; done ;;
  stop) stop_all ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
