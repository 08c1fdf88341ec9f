#!/usr/bin/env bash
# A one-node SLURM cluster for tests and laptops: munge, MariaDB, slurmdbd, slurmctld, slurmd.
#
#   bash launchers/slurm/cluster.sh install   # Debian packages (apt-get), idempotent
#   bash launchers/slurm/cluster.sh start     # write configs, start the daemons, wait for an idle node
#   bash launchers/slurm/cluster.sh stop      # stop the daemons this script started (by pid file)
#   bash launchers/slurm/cluster.sh status    # which daemons run, and sinfo
#
# Runs as root and needs no systemd (containers, CI).  Accounting (slurmdbd + MariaDB) is not
# optional: submitit learns that a job was cancelled, killed or timed out from `sacct`; without
# it a campaign waits forever on a job that died.
set -euo pipefail

CLUSTER_NAME="${RETRAIN_SLURM_CLUSTER:-retrain}"
PARTITION="${RETRAIN_SLURM_PARTITION:-debug}"
NODE="$(hostname -s)"
CONF_DIR=/etc/slurm
RUN_DIR=/run/retrain-slurm
LOG_DIR=/var/log/slurm
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=retrain-slurmdbd
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

require_root() { [[ $(id -u) -eq 0 ]] || die "run as root (installs packages and starts daemons)"; }

pid_alive() {  # pid_alive FILE: the pid in FILE is a live, non-zombie process
  local file=$1 pid state
  pid=$({ tr -dc '0-9' <"$file"; } 2>/dev/null) || return 1  # daemons delete their pid file on exit
  [[ -n $pid ]] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z ]]
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what"
    sleep 0.5
  done
}

cmd_install() {
  require_root
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v slurmdbd >/dev/null \
    && command -v sinfo >/dev/null && command -v munged >/dev/null && command -v mariadbd >/dev/null; then
    log "already installed: slurm $(dpkg-query -W -f='${Version}' slurmctld)"
    return 0
  fi
  log "installing ${PACKAGES[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
  log "installed: slurm $(dpkg-query -W -f='${Version}' slurmctld)"
}

node_memory_mb() {  # leave 1 GiB to the system
  awk '/MemTotal/ {m = int($2 / 1024) - 1024; print (m > 1024 ? m : 1024)}' /proc/meminfo
}

write_configs() {
  mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
  cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by launchers/slurm/cluster.sh: a one-node cluster, every daemon as root.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# No cgroups in containers: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Share the node between jobs by cores and memory (else jobs run one at a time).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
# Accounting: sacct is how submitit sees cancelled, killed and timed-out jobs.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Fast turnaround for tests: short kill wait, quick return of a rebooted node.
KillWait=5
MinJobAge=60
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=defer_batch=0
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(node_memory_mb) State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$CONF_DIR/slurmdbd.conf" <<EOF
# Written by launchers/slurm/cluster.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
EOF
  chmod 600 "$CONF_DIR/slurmdbd.conf"
}

start_munge() {
  if pid_alive /run/munge/munged.pid; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 20 munged munge -n
}

mariadb_up() { mariadb-admin --protocol=socket ping; }

start_mariadb() {
  if mariadb_up >/dev/null 2>&1; then return 0; fi
  mkdir -p /run/mysqld
  chown mysql:mysql /run/mysqld
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  fi
  # Detached: a daemon that outlives this script, with its own pid file.
  setsid mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid --skip-networking=0 \
    --bind-address=127.0.0.1 >"$LOG_DIR/mariadb.log" 2>&1 </dev/null &
  wait_for 60 MariaDB mariadb_up
  mariadb --protocol=socket <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
  if pid_alive "$RUN_DIR/slurmdbd.pid"; then return 0; fi
  slurmdbd
  wait_for 60 slurmdbd sacctmgr -n show cluster
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
    sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null
  fi
}

node_usable() {  # the node answers and is idle, mixed or allocated (not down/drained)
  local state
  state=$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null | head -1)
  [[ $state =~ ^(idle|mix|alloc|comp) ]]
}

start_slurm() {
  if ! pid_alive "$RUN_DIR/slurmctld.pid"; then slurmctld; fi
  wait_for 60 slurmctld scontrol ping
  if ! pid_alive "$RUN_DIR/slurmd.pid"; then slurmd; fi
  local deadline=$((SECONDS + 60))
  until node_usable; do
    # A node that "unexpectedly rebooted" (new container, same state dir) is brought back.
    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
    ((SECONDS < deadline)) || die "node $NODE not usable: $(sinfo -h -N -o '%N %t %E' 2>&1)"
    sleep 1
  done
}

cmd_start() {
  require_root
  command -v slurmctld >/dev/null || die "SLURM is not installed: run '$0 install' first"
  local t0=$SECONDS
  write_configs
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurm
  log "cluster '$CLUSTER_NAME' up in $((SECONDS - t0))s: partition $PARTITION on $NODE ($(nproc) CPUs)"
}

stop_pidfile() {  # stop_pidfile NAME FILE: TERM the process named in FILE and wait until it is gone
  local name=$1 file=$2 pid deadline
  pid_alive "$file" || { rm -f "$file"; return 0; }
  pid=$({ tr -dc '0-9' <"$file"; } 2>/dev/null) || return 0
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 30))
  while pid_alive "$file"; do  # a stopped daemon lingers as a zombie for a few seconds: that counts as gone
    ((SECONDS < deadline)) || { log "$name ($pid) ignored TERM: killing"; kill -KILL "$pid" 2>/dev/null || true; break; }
    sleep 0.5
  done
  rm -f "$file"
  log "stopped $name ($pid)"
}

cmd_stop() {
  require_root
  stop_pidfile slurmd "$RUN_DIR/slurmd.pid"
  stop_pidfile slurmctld "$RUN_DIR/slurmctld.pid"
  stop_pidfile slurmdbd "$RUN_DIR/slurmdbd.pid"
  stop_pidfile mariadbd /run/mysqld/mysqld.pid
  stop_pidfile munged /run/munge/munged.pid
}

cmd_status() {
  local rc=0 name file
  for name in munged mariadbd slurmdbd slurmctld slurmd; do
    case $name in
      munged) file=/run/munge/munged.pid ;;
      mariadbd) file=/run/mysqld/mysqld.pid ;;
      *) file=$RUN_DIR/$name.pid ;;
    esac
    if pid_alive "$file"; then
      printf '%-10s running (pid %s)\n' "$name" "$(tr -dc '0-9' <"$file")"
    else
      printf '%-10s stopped\n' "$name"
      rc=1
    fi
  done
  if ((rc == 0)); then sinfo; fi
  return $rc
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
