#!/usr/bin/env bash
# Multi-host training: run this once on EVERY host (one process per host, all local GPUs).
# jax.distributed connects the processes; the mesh spans the devices of all hosts.
#
#   COORDINATOR=host0:12345 NUM_HOSTS=4 HOST_RANK=<0..3> \
#     launch/multi_host.sh configs/paper_8gpu_strict_full.yaml --mesh data=4,fsdp=8
#
# HOST_RANK defaults to the rank variables of SLURM / OpenMPI / torchrun when present.
# Every host needs the same code, config, checkpoints and data at the same paths; the output
# and checkpoint directory must be shared storage (Orbax writes one checkpoint from all hosts).
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
CONFIG="${1:?usage: launch/multi_host.sh CONFIG [--mesh ...] [--set ...] [--resume]}"
shift
export CTOPD_COORDINATOR="${COORDINATOR:?set COORDINATOR=host:port (host of rank 0)}"
export CTOPD_NUM_PROCESSES="${NUM_HOSTS:-${SLURM_NNODES:-${OMPI_COMM_WORLD_SIZE:-${WORLD_SIZE:-}}}}"
export CTOPD_PROCESS_ID="${HOST_RANK:-${SLURM_NODEID:-${OMPI_COMM_WORLD_RANK:-${RANK:-}}}}"
: "${CTOPD_NUM_PROCESSES:?set NUM_HOSTS}" "${CTOPD_PROCESS_ID:?set HOST_RANK}"
exec "$PY" -m ctopd_jax.train --config "$CONFIG" "$@"
