#!/usr/bin/env bash
# srun_cluster.sh RANKS PROGRAM [ARGS...]: starts a one-node Slurm cluster on
# this machine (munged, slurmctld and slurmd, all configured in a temporary
# directory), then runs PROGRAM as RANKS MPI ranks with
# `srun --mpi=pmix -n RANKS`, the way users start loom on a cluster, and
# stops every daemon it started, also on failure.
#
# Debian's Open MPI 4.1 is built against PMIx (libpmix2), which Slurm's
# mpi/pmix plugin (slurm-wlm-basic-plugins) serves; it has no PMI2 client,
# so --mpi=pmi2 does not start it. The Debian packages (LOOM_SLURM_PACKAGES
# in scripts/lib.sh) are installed when missing and this runs as root.
# Root is needed anyway: slurmd starts the job's tasks and runs as root.
#
# The node declares RANKS CPUs whatever the machine has (CI has 2 cores);
# slurmd's config_overrides makes it report the declared count rather than
# drain the node for having fewer.
#
# Exit status: srun's (PROGRAM's), 77 (CTest's skip) when the cluster
# cannot be installed or started, 2 for a wrong command line.
set -euo pipefail

SKIP=77
if (( $# < 2 )); then
  echo "usage: $0 RANKS PROGRAM [ARGS...]" >&2
  exit 2
fi
ranks="$1"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

skip() {
  echo "skipped: $*" >&2
  exit "$SKIP"
}

(( EUID == 0 )) || skip "slurmd must run as root to start the job's tasks; run this test as root"

# shellcheck source-path=SCRIPTDIR source=../../scripts/lib.sh
source "$here/../../scripts/lib.sh"
loom_install_packages "${LOOM_SLURM_PACKAGES[@]}" ||
  skip "installing ${LOOM_SLURM_PACKAGES[*]} failed"

dir="$(mktemp -d "${TMPDIR:-/tmp}/loom-slurm.XXXXXX")"
# munged refuses a socket in a directory others cannot pass through.
chmod 711 "$dir"
pids=()
names=()
# Prints the daemons' logs after a failure, cancels what is left of the job
# (interrupted, its ranks would outlive srun: slurmd's step daemon starts
# them in a session of their own), waits up to 15 s until the job has left
# the queue (its step daemon has then ended), stops the daemons, newest
# first, and removes the directory.
stop_cluster() {
  local status=$? pid log i
  if (( status != 0 )); then
    for log in "$dir"/*.log; do
      [[ -s "$log" ]] || continue
      echo "---- $log (last 30 lines)" >&2
      tail -n 30 "$log" >&2
    done
  fi
  if (( ${#pids[@]} == 3 )) && kill -0 "${pids[1]}" 2> /dev/null; then
    scancel --quiet --user=root 2> /dev/null || true
    for (( i = 0; i < 15; ++i )); do
      [[ -z "$(squeue -h 2> /dev/null || true)" ]] && break
      sleep 1
    done
  fi
  for (( i = ${#pids[@]} - 1; i >= 0; --i )); do
    pid="${pids[i]}"
    kill "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
  done
  rm -rf "$dir"
  exit "$status"
}
trap stop_cluster EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# Ports of this run's own (CTest may run another cluster at the same time,
# and the defaults 6817/6818 may belong to a real Slurm on this machine).
base_port=$(( 20000 + $$ % 10000 * 2 ))
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" <<EOF
ClusterName=loomci
SlurmctldHost=localhost
SlurmctldPort=$base_port
SlurmdPort=$(( base_port + 1 ))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName=loomnode NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$ranks State=UNKNOWN
PartitionName=loom Nodes=loomnode Default=YES MaxTime=INFINITE State=UP
EOF
# Run inside a job of a real cluster, srun would join that job (SLURM_JOB_ID
# and the rest): this cluster's commands see none of it.
unset "${!SLURM_@}"
export SLURM_CONF="$dir/slurm.conf"

# A key of this cluster's own, readable by root only (munged refuses others).
head -c 1024 /dev/urandom > "$dir/munge.key"
chmod 400 "$dir/munge.key"
munged --foreground --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
  --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed" > "$dir/munged.log" 2>&1 &
pids+=($!)
names+=(munged)
slurmctld -D -i > "$dir/slurmctld.out.log" 2>&1 &
pids+=($!)
names+=(slurmctld)
slurmd -D -N loomnode > "$dir/slurmd.out.log" 2>&1 &
pids+=($!)
names+=(slurmd)

# The node takes a few seconds to register; 60 s covers a loaded CI machine.
state=""
for (( waited = 0; waited < 60; ++waited )); do
  for i in "${!pids[@]}"; do
    kill -0 "${pids[i]}" 2> /dev/null || skip "${names[i]} exited while starting; the logs are below"
  done
  state="$(sinfo -h -n loomnode -o %T 2> /dev/null || true)"
  [[ "$state" == idle ]] && break
  sleep 1
done
[[ "$state" == idle ]] ||
  skip "the Slurm node did not become idle within 60 s (sinfo says '${state:-nothing}'); the logs are below"

echo "loom: one-node Slurm cluster up in $dir; srun --mpi=pmix -n $ranks $*" >&2
# In the background, so that a signal to this script runs its traps (and
# cancels the job) at once rather than when srun ends.
srun --mpi=pmix -n "$ranks" "$@" &
wait $!
