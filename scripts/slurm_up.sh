#!/usr/bin/env bash
# Bring up a real SLURM cluster on this (Debian, root) machine, for tests: this host as a one-node
# partition, and two more nodes, each in its own network and UTS namespace, as a two-node partition.
#
#   scripts/slurm_up.sh      # idempotent: running it again is harmless
#   scripts/slurm_down.sh    # stops it again
#
# What it does:
#   * installs `slurm-wlm` and `munge` with apt-get, only if they are missing;
#   * creates the munge key (/etc/munge/munge.key, owned by munge) and starts `munged` as munge;
#   * makes eight fake GPUs (character devices `mknod /dev/fakegpuN c 1 3`, i.e. /dev/null clones);
#   * makes the two extra nodes' network: a bridge `deitbr0` (10.211.0.1/24) in the root namespace and,
#     per node nK, a network namespace `deit-nK` joined to the bridge by a veth pair, address
#     10.211.0.1K, `lo` up; `nK` goes into /etc/hosts (marked, removed again by slurm_down.sh) so the
#     names in SLURM_JOB_NODELIST resolve everywhere;
#   * writes /etc/slurm/slurm.conf and /etc/slurm/gres.conf: three nodes, each advertised with
#     CPUs=16 RealMemory=16000 Gres=gpu:8 (SlurmdParameters=config_overrides lets slurmd accept a
#     node bigger than the machine): this host in partition `debug` (default) and a higher-priority
#     partition `urgent` whose jobs preempt (requeue) `debug` jobs; n1 and n2 in partition `multi`
#     (two-node jobs: hydra.launcher.partition=multi hydra.launcher.nodes=2); accounting off,
#     JobRequeue=1; every slurmd has its own spool, pid and log file (%n = its node name);
#   * installs a small `sacct` shim so submitit sees job states although accounting is off;
#   * starts slurmctld, this host's slurmd, and one slurmd per extra node inside its namespaces
#     (`nsenter --net=/run/netns/deit-nK unshare --uts`, hostname nK; nsenter rather than `ip netns
#     exec`, which remounts /sys and breaks slurmd's cgroup set-up), restarting them if the config
#     changed, and waits until every node is idle.
#
# Environment knobs (all optional):
#   SLURM_UP_TIMEOUT   seconds to wait for the nodes to become idle (default 60)
#   SLURM_UP_EXTRA_NODES number of namespace nodes for the `multi` partition (default 2; 0: only
#                      this host, no bridge, no namespaces)
#   SLURM_UP_SUBNET    first three octets of their network (default 10.211.0)
#   SLURM_UP_CPUS      CPUs advertised for the node (default 16)
#   SLURM_UP_MEM_MB    RealMemory advertised for the node, in MB (default 16000)
#   SLURM_UP_GPUS      number of fake GPUs (default 8)
#   SLURM_UP_SACCT_SHIM 1 (default): install /usr/local/bin/sacct, a shim answering submitit's
#                      job-state query from `scontrol show job` (see below); 0: remove it
set -euo pipefail

TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
NODE_CPUS="${SLURM_UP_CPUS:-16}"
NODE_MEM_MB="${SLURM_UP_MEM_MB:-16000}"
NGPUS="${SLURM_UP_GPUS:-8}"
SACCT_SHIM="${SLURM_UP_SACCT_SHIM:-1}"
EXTRA_NODES="${SLURM_UP_EXTRA_NODES:-2}"
SUBNET="${SLURM_UP_SUBNET:-10.211.0}"

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
GPU_PREFIX=/dev/fakegpu
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
CTLD_PID="$RUN_DIR/slurmctld.pid"
BRIDGE=deitbr0
BRIDGE_ADDR="$SUBNET.1"
HOSTS_MARK="# deit_ablate slurm_up node"
SHIM_PATH=/usr/local/bin/sacct
SHIM_MARK=deit_ablate-sacct-shim

log() { echo "[slurm_up] $*"; }
die() { echo "[slurm_up] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts daemons)"

pid_alive() {  # pid_alive PIDFILE -> 0 if the process named in PIDFILE is running
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM the process, wait up to 15 s for it to go
    local pid i
    pid_alive "$1" || { rm -f "$1"; return 0; }
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

dump_logs() {
    echo "----- $LOG_DIR/slurmctld.log (last 60 lines) -----" >&2
    tail -n 60 "$LOG_DIR/slurmctld.log" >&2 2>/dev/null || echo "(missing)" >&2
    local node
    for node in "${NODES[@]}"; do
        echo "----- $LOG_DIR/slurmd-$node.log (last 40 lines) -----" >&2
        tail -n 40 "$LOG_DIR/slurmd-$node.log" >&2 2>/dev/null || echo "(missing)" >&2
    done
    echo "----- /var/log/munge/munged.log (last 20 lines) -----" >&2
    tail -n 20 /var/log/munge/munged.log >&2 2>/dev/null || echo "(missing)" >&2
}

# ---------------------------------------------------------------------------------------------
# 1. packages
# ---------------------------------------------------------------------------------------------
missing=()
for bin in slurmctld slurmd sinfo sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
packages=(slurm-wlm munge)
if [ "$EXTRA_NODES" != 0 ]; then  # the namespace nodes need ip (iproute2), nsenter and unshare (util-linux)
    for bin in ip nsenter unshare; do
        command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
    done
    packages+=(iproute2 util-linux)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    log "missing ${missing[*]}: installing ${packages[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # Services are not started by the packages (no systemd here; policy-rc.d may forbid it anyway);
    # this script starts the daemons itself.
    apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${packages[@]}"
else
    log "${packages[*]} already installed"
fi
for bin in slurmctld slurmd sinfo sbatch scontrol munged munge unmunge; do
    command -v "$bin" >/dev/null 2>&1 || die "$bin not found after installing slurm-wlm and munge"
done
if [ "$EXTRA_NODES" != 0 ]; then
    for bin in ip nsenter unshare; do
        command -v "$bin" >/dev/null 2>&1 || die "$bin not found after installing iproute2 and util-linux"
    done
fi

HOST="$(hostname -s)"
[ -n "$HOST" ] || die "hostname -s is empty"
getent hosts "$HOST" >/dev/null || die "hostname '$HOST' does not resolve; add it to /etc/hosts"
case "$EXTRA_NODES" in ''|*[!0-9]*) die "SLURM_UP_EXTRA_NODES must be a number (got '$EXTRA_NODES')";; esac
[ "$EXTRA_NODES" -le 8 ] || die "SLURM_UP_EXTRA_NODES=$EXTRA_NODES: at most 8 namespace nodes"
EXTRA=()
for k in $(seq 1 "$EXTRA_NODES"); do EXTRA+=("n$k"); done
NODES=("$HOST" "${EXTRA[@]}")
node_addr() { echo "$SUBNET.$((10 + ${1#n}))"; }  # n1 -> 10.211.0.11
slurmd_pid() { echo "$RUN_DIR/slurmd-$1.pid"; }
SLURM_USER=root
if id slurm >/dev/null 2>&1; then SLURM_USER=slurm; fi

# ---------------------------------------------------------------------------------------------
# 2. munge
# ---------------------------------------------------------------------------------------------
id munge >/dev/null 2>&1 || die "user 'munge' does not exist (the munge package should create it)"
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s "$MUNGE_KEY" ]; then
    log "creating munge key $MUNGE_KEY"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$MUNGE_KEY" --force
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
fi
chown munge:munge "$MUNGE_KEY"
chmod 0400 "$MUNGE_KEY"

if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running (pid $(cat "$MUNGE_PID" 2>/dev/null || echo '?'))"
else
    stop_pidfile "$MUNGE_PID" munged
    log "starting munged as user munge"
    # --force: start even if a stale socket from an unclean stop is left behind
    runuser -u munge -- munged --force
    for i in $(seq 1 20); do
        munge -n </dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.5
    done
    munge -n </dev/null | unmunge >/dev/null 2>&1 || { dump_logs; die "munged does not answer"; }
    log "munged up (pid $(cat "$MUNGE_PID" 2>/dev/null || echo '?'))"
fi

# ---------------------------------------------------------------------------------------------
# 3. fake GPUs
# ---------------------------------------------------------------------------------------------
last=$((NGPUS - 1))
for i in $(seq 0 "$last"); do
    dev="$GPU_PREFIX$i"
    if [ ! -c "$dev" ]; then
        rm -f "$dev"
        mknod -m 0666 "$dev" c 1 3
    fi
done
log "fake GPUs: ${GPU_PREFIX}[0-$last]"

# ---------------------------------------------------------------------------------------------
# 4. the extra nodes' network: a bridge here, one network namespace per node joined to it by a veth
#    pair, and the node names in /etc/hosts (every address stays inside what this script creates)
# ---------------------------------------------------------------------------------------------
if [ "${#EXTRA[@]}" -gt 0 ]; then
    command -v ip >/dev/null 2>&1 || die "'ip' not found (package iproute2) but needed for the namespace nodes"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "creating bridge $BRIDGE ($BRIDGE_ADDR/24)"
        ip link add "$BRIDGE" type bridge
    fi
    ip addr show dev "$BRIDGE" | grep -q "inet $BRIDGE_ADDR/" || ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for node in "${EXTRA[@]}"; do
        ns="deit-$node" veth="veth-$node" addr="$(node_addr "$node")"
        [ -e "/run/netns/$ns" ] || { log "creating network namespace $ns ($addr)"; ip netns add "$ns"; }
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip -n "$ns" link del eth0 2>/dev/null || true
            ip link add "$veth" type veth peer name eth0 netns "$ns"
        fi
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" addr show dev eth0 | grep -q "inet $addr/" || ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        if ! grep -q "^$addr $node $HOSTS_MARK\$" /etc/hosts; then
            # rewritten in place, not with sed -i, which fails where /etc/hosts is a mount point
            kept="$(grep -v " $node $HOSTS_MARK\$" /etc/hosts || true)"
            printf '%s\n%s\n' "$kept" "$addr $node $HOSTS_MARK" >/etc/hosts
        fi
    done
    log "namespace nodes: ${EXTRA[*]} on $BRIDGE ($SUBNET.0/24)"
fi

# ---------------------------------------------------------------------------------------------
# 5. config files
# ---------------------------------------------------------------------------------------------
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR"
for node in "${NODES[@]}"; do install -d -m 0755 "$SPOOL_DIR/$node"; done
install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0755 "$STATE_DIR"
chown "$SLURM_USER:$SLURM_USER" "$LOG_DIR" "$RUN_DIR"

CHANGED=0
write_if_changed() {  # write_if_changed PATH [MODE] (content on stdin); returns 0 if (re)written
    local tmp
    tmp="$(mktemp)"
    cat >"$tmp"
    if [ -f "$1" ] && cmp -s "$tmp" "$1"; then
        rm -f "$tmp"
        return 1
    fi
    log "writing $1"
    install -m "${2:-0644}" "$tmp" "$1"
    rm -f "$tmp"
    return 0
}

CTLD_HOST="$HOST"
EXTRA_CONF=""
if [ "${#EXTRA[@]}" -gt 0 ]; then
    # the namespace nodes reach the controller at the bridge's address
    CTLD_HOST="$HOST($BRIDGE_ADDR)"
    EXTRA_CONF="# two-node jobs: each node its own network + UTS namespace (see the top of slurm_up.sh)"
    for node in "${EXTRA[@]}"; do
        EXTRA_CONF+=$'\n'"NodeName=$node NodeAddr=$(node_addr "$node") CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:$NGPUS State=UNKNOWN"
    done
    EXTRA_CONF+=$'\n'"PartitionName=multi Nodes=$(IFS=,; echo "${EXTRA[*]}") Default=NO MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30"
fi

if write_if_changed "$CONF_DIR/slurm.conf" <<EOF
# Generated by deit_ablate scripts/slurm_up.sh -- test cluster. Edits are overwritten.
ClusterName=deitlocal
SlurmctldHost=$CTLD_HOST
SlurmUser=$SLURM_USER
AuthType=auth/munge
# job-step credential lifetime; it is also the delay before a requeued job may start again
# (default 120 s, far too slow for tests)
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# accept a node description bigger than the real machine (16 CPUs, 16 GB, 8 GPUs on a 2-core VM)
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

# accounting off: the real sacct answers "accounting storage is disabled"; submitit's state
# polling goes through the sacct shim this script installs (/usr/local/bin/sacct)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

# scheduling: quick, CPUs/GPUs consumable (memory is not, so --mem only has to fit RealMemory)
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu

# requeue / preemption: jobs may be requeued (scontrol requeue, submitit's own requeue);
# a job in partition "urgent" preempts (requeues) "debug" jobs; the job's --signal (submitit's
# USR2) is sent at preemption, then GraceTime seconds later the job is killed and requeued.
JobRequeue=1
# reject at submit time a job that can never fit (e.g. 8 tasks x 10 CPUs on this 16-CPU node)
# instead of leaving it pending forever with Reason=PartitionConfig
EnforcePartLimits=ALL
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal

# short timeouts so tests are fast; finished jobs stay visible to scontrol for 5 minutes
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
UnkillableStepTimeout=30

NodeName=$HOST NodeAddr=$HOST CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:$NGPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=$HOST Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
$EXTRA_CONF
EOF
then CHANGED=1; fi

if write_if_changed "$CONF_DIR/gres.conf" <<EOF
# Generated by deit_ablate scripts/slurm_up.sh -- fake GPUs (mknod c 1 3), no autodetection.
AutoDetect=off
Name=gpu File=${GPU_PREFIX}[0-$last]
EOF
then CHANGED=1; fi

# sacct shim. With accounting off the real sacct fails, and submitit (which polls job states only
# through `sacct`) then sees every job as UNKNOWN: a job whose tasks die without writing their
# result pickle (time limit reached, scancel, OOM, a killed rank) leaves the Hydra multirun
# driver waiting forever. The shim answers submitit's one query from `scontrol show job` (jobs
# stay visible there MinJobAge=300 s after they end) and passes every other call to /usr/bin/sacct.
# Disable (and remove it) with SLURM_UP_SACCT_SHIM=0.
if [ "$SACCT_SHIM" = 1 ]; then
    if [ -e "$SHIM_PATH" ] && ! grep -q "$SHIM_MARK" "$SHIM_PATH"; then
        log "WARNING: $SHIM_PATH exists and is not ours; not installing the sacct shim"
    else
        write_if_changed "$SHIM_PATH" 0755 <<'SHIM' || true
#!/bin/bash
# deit_ablate-sacct-shim (written by scripts/slurm_up.sh; test cluster without accounting).
# Answers submitit's status query
#   sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
# from `scontrol show job`; any other call goes to the real /usr/bin/sacct.
set -uo pipefail
fmt="" ids=()
args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        -o | --format) fmt="${2:-}"; shift 2 || break ;;
        --format=*) fmt="${1#--format=}"; shift ;;
        -j | --jobs) ids+=(${2//,/ }); shift 2 || break ;;
        --jobs=*) v="${1#--jobs=}"; ids+=(${v//,/ }); shift ;;
        --parsable2 | -P) shift ;;
        *) exec /usr/bin/sacct "${args[@]}" ;;
    esac
done
if [ "$fmt" != "JobID,State,NodeList" ] || [ "${#ids[@]}" -eq 0 ]; then
    exec /usr/bin/sacct "${args[@]}"
fi
echo "JobID|State|NodeList"
for id in "${ids[@]}"; do
    scontrol show job -o "$id" 2>/dev/null | awk '
        function get(k,   off) {
            if (!match($0, "(^| )" k "=[^ ]*")) return ""
            off = (substr($0, RSTART, 1) == " ") ? 1 : 0
            return substr($0, RSTART + off + length(k) + 1, RLENGTH - off - length(k) - 1)
        }
        /JobId=/ {
            jid = get("JobId"); aj = get("ArrayJobId"); at = get("ArrayTaskId")
            if (aj != "" && at != "") jid = (at ~ /[-,%]/) ? aj "_[" at "]" : aj "_" at
            nl = get("NodeList"); if (nl == "" || nl == "(null)") nl = "None assigned"
            print jid "|" get("JobState") "|" nl
        }'
done
exit 0
SHIM
        log "sacct shim at $SHIM_PATH (submitit reads job states from scontrol)"
    fi
elif [ -e "$SHIM_PATH" ] && grep -q "$SHIM_MARK" "$SHIM_PATH"; then
    log "SLURM_UP_SACCT_SHIM=0: removing the sacct shim $SHIM_PATH"
    rm -f "$SHIM_PATH"
fi

# ---------------------------------------------------------------------------------------------
# 6. daemons
# ---------------------------------------------------------------------------------------------
stop_all_slurmd() {  # every slurmd of this cluster, and one left by an older single-pid-file layout
    local pidfile
    for pidfile in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmd.pid"; do
        [ -e "$pidfile" ] && stop_pidfile "$pidfile" "slurmd ($(basename "$pidfile"))"
    done
    return 0
}
if [ "$CHANGED" -eq 1 ] || [ -e "$RUN_DIR/slurmd.pid" ]; then
    if pid_alive "$CTLD_PID" || ls "$RUN_DIR"/slurmd*.pid >/dev/null 2>&1; then
        log "configuration changed: restarting slurm daemons"
        stop_all_slurmd
        stop_pidfile "$CTLD_PID" slurmctld
    fi
fi

if pid_alive "$CTLD_PID"; then
    log "slurmctld already running (pid $(cat "$CTLD_PID"))"
else
    log "starting slurmctld"
    slurmctld || { dump_logs; die "slurmctld failed to start"; }
fi
for node in "${NODES[@]}"; do
    if pid_alive "$(slurmd_pid "$node")"; then
        log "slurmd $node already running (pid $(cat "$(slurmd_pid "$node")"))"
    elif [ "$node" = "$HOST" ]; then
        log "starting slurmd $node"
        slurmd -N "$node" || { dump_logs; die "slurmd $node failed to start"; }
    else
        log "starting slurmd $node in namespace deit-$node"
        nsenter --net="/run/netns/deit-$node" unshare --uts sh -c "hostname $node && exec slurmd -N $node" ||
            { dump_logs; die "slurmd $node failed to start"; }
    fi
done

wait_idle() {  # wait_idle NODE: until the controller reports NODE usable, resuming it once if down
    local node="$1" state resumed=0
    while :; do
        state="$(sinfo -h -n "$node" -o '%T' 2>/dev/null | head -n 1 || true)"
        case "$state" in
            idle | mixed | allocated | completing)
                return 0 ;;
            drain* | down* | fail*)
                # e.g. left DOWN/DRAINED by an earlier unclean stop: put it back in service once
                if [ "$resumed" -eq 0 ]; then
                    log "node $node is '$state', resuming it"
                    scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        if [ $(($(date +%s) - start)) -ge "$TIMEOUT" ]; then
            echo "[slurm_up] ERROR: node $node not idle after ${TIMEOUT}s (state: '${state:-unknown}')" >&2
            sinfo -N -l >&2 2>/dev/null || true
            scontrol show node "$node" >&2 2>/dev/null || true
            dump_logs
            exit 1
        fi
        sleep 0.5
    done
}

log "waiting up to ${TIMEOUT}s for nodes ${NODES[*]} to be idle"
start=$(date +%s)
for node in "${NODES[@]}"; do wait_idle "$node"; done
log "cluster up: nodes ${NODES[*]} idle (waited $(($(date +%s) - start))s)"
sinfo
