#!/usr/bin/env bash
# Stop the test SLURM cluster started by scripts/slurm_up.sh and remove its namespace nodes' network.
#
#   scripts/slurm_down.sh           # cancel all jobs, stop every slurmd, slurmctld and munged, delete the
#                                   # deit-nK network namespaces, the deitbr0 bridge and the nK lines
#                                   # slurm_up.sh added to /etc/hosts
#   scripts/slurm_down.sh --purge   # same, then also forget all job state (StateSaveLocation,
#                                   # slurmd spool) so the next slurm_up starts at a clean slate
#
# Harmless if nothing is running. Packages, config files, the munge key and the fake GPU devices
# are left in place, so slurm_up.sh brings the cluster back in about a second.
set -euo pipefail

STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
RUN_DIR=/run/slurm
MUNGE_PID=/run/munge/munged.pid
CTLD_PID="$RUN_DIR/slurmctld.pid"
BRIDGE=deitbr0
HOSTS_MARK="# deit_ablate slurm_up node"

PURGE=0
for arg in "$@"; do
    case "$arg" in
        --purge) PURGE=1 ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "[slurm_down] ERROR: unknown argument '$arg' (only --purge)" >&2; exit 2 ;;
    esac
done

log() { echo "[slurm_down] $*"; }

[ "$(id -u)" -eq 0 ] || { echo "[slurm_down] ERROR: must run as root" >&2; exit 1; }

pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM, wait up to 15 s, then SIGKILL
    local pid i
    if ! pid_alive "$1"; then
        log "$2 not running"
        rm -f "$1"
        return 0
    fi
    pid="$(cat "$1")"
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 30); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
        sleep 0.5
    done
    log "$2 did not stop after 15 s, sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

# 1. cancel every job while the controller still answers, and give the steps time to end
if pid_alive "$CTLD_PID" && command -v squeue >/dev/null 2>&1; then
    jobs="$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)"
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for i in $(seq 1 40); do
            [ -z "$(squeue -h -o '%A' 2>/dev/null || true)" ] && break
            sleep 0.5
        done
        left="$(squeue -h -o '%A %T' 2>/dev/null | tr '\n' ';' || true)"
        [ -z "$left" ] || log "jobs still listed after 20 s (they die with slurmd): $left"
    else
        log "no jobs queued"
    fi
fi

# 2. daemons: slurmd first (it kills its job steps), then the controller, then munge
for pidfile in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmd.pid"; do
    [ -e "$pidfile" ] && stop_pidfile "$pidfile" "slurmd ($(basename "$pidfile" .pid))"
done
stop_pidfile "$CTLD_PID" slurmctld
stop_pidfile "$MUNGE_PID" munged

if [ "$PURGE" -eq 1 ]; then
    log "purging job state in $STATE_DIR and $SPOOL_DIR"
    rm -rf "${STATE_DIR:?}"/* "${SPOOL_DIR:?}"/*
fi

# 3. the namespace nodes' network: their namespaces (the veth pairs go with them), the bridge, /etc/hosts
if command -v ip >/dev/null 2>&1; then
    for ns in /run/netns/deit-n*; do
        [ -e "$ns" ] || continue
        log "deleting network namespace $(basename "$ns")"
        ip netns del "$(basename "$ns")" || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "deleting bridge $BRIDGE"
        ip link del "$BRIDGE" || true
    fi
fi
if grep -q "$HOSTS_MARK\$" /etc/hosts 2>/dev/null; then
    log "removing the namespace nodes from /etc/hosts"
    # in place (sed -i would replace the file, which fails where /etc/hosts is a mount point)
    kept="$(grep -v "$HOSTS_MARK\$" /etc/hosts)"
    printf '%s\n' "$kept" >/etc/hosts
fi

log "cluster stopped"
