# Sourced by the sbatch scripts of this folder (not submitted itself).
#
#   tlt_train [SRUN_OPTION ...] -- CONFIG [key=value ...] [--compare-baseline ...]
#
# runs `nemo-tlt train` as one srun step whose tasks are the workers (one task = one
# rank, workers.launcher=slurm: the rendezvous comes from SLURM's variables) and
# returns its exit status (0 done, 2 bad config or environment, 130 interrupted and
# checkpointed). Around the step:
#   * resume: a requeued job (SLURM_RESTART_COUNT > 0) continues its run (resume=true);
#   * preemption / time limit: `#SBATCH --signal=B:USR1@N` signals only this batch
#     shell, so the step runs in the background and the trap forwards USR1 to srun,
#     which forwards it to every task; the ranks stop at the next step boundary and
#     rank 0 checkpoints (nemo_tlt.dist.StopFlag); then the job requeues itself
#     (`scontrol requeue`, needs `#SBATCH --requeue`) and its next start resumes.
# Environment (optional):
#   TLT_PYTHON      the python that has nemo-tlt installed (default: python)
#   TLT_SRUN_FLAGS  more srun flags, word-split: container flags, ... (no per-task GPU
#                   binding: every task sees its node's GPUs and binds cuda:SLURM_LOCALID)
#   TLT_RDZV_PORT   rendezvous port (default: derived from the job id)
# Network interfaces (GPU jobs; read by `tlt_network_env`): NCCL carries the tensor
# collectives, gloo the Python objects and coordination. Both pick an interface
# themselves, which is right on most clusters, so nothing is set by default; export one
# before sbatch (srun passes the environment to every task) where the pick is wrong,
# e.g. nodes with several NICs or a container bridge:
#   NCCL_SOCKET_IFNAME  NCCL's bootstrap / socket interface: ib0, eth0, or an exclusion
#                       list such as ^docker0,lo
#   GLOO_SOCKET_IFNAME  gloo's interface (one name, no exclusions): ib0, eth0
#   NCCL_IB_HCA         the InfiniBand adapters NCCL may use: mlx5, or mlx5_0:1,mlx5_1:1
#   NCCL_DEBUG=INFO     NCCL prints the interfaces and transports it chose

tlt_network_env() {
    local name
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG; do
        if [ -n "${!name:-}" ]; then
            export "${name?}"
            echo "tlt: $name=${!name}" >&2
        fi
    done
}

tlt_forward_usr1() {
    TLT_SIGNALLED=1
    echo "tlt: USR1 (preemption or time limit ahead): forwarding it to the workers" >&2
    kill -USR1 "$TLT_SRUN_PID" 2>/dev/null
}

tlt_train() {
    local srun_opts=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do srun_opts+=("$1"); shift; done
    if [ $# -eq 0 ]; then
        echo "tlt_train: usage: tlt_train [SRUN_OPTION ...] -- CONFIG [key=value ...]" >&2
        return 2
    fi
    shift
    local args=("$@")
    if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
        echo "tlt: requeued job (restart ${SLURM_RESTART_COUNT}): continuing with resume=true" >&2
        args+=("resume=true")
    fi
    TLT_SIGNALLED=
    # shellcheck disable=SC2086  # TLT_SRUN_FLAGS is a list of flags on purpose
    srun --kill-on-bad-exit=1 "${srun_opts[@]}" ${TLT_SRUN_FLAGS:-} \
        "${TLT_PYTHON:-python}" -m nemo_tlt.cli train "${args[@]}" workers.launcher=slurm &
    TLT_SRUN_PID=$!
    trap tlt_forward_usr1 USR1
    local rc
    wait "$TLT_SRUN_PID"; rc=$?
    # `wait` returns early when a trapped signal arrives: wait again until srun is gone.
    while kill -0 "$TLT_SRUN_PID" 2>/dev/null; do wait "$TLT_SRUN_PID"; rc=$?; done
    trap - USR1
    if [ "$rc" -eq 130 ] && [ -n "$TLT_SIGNALLED" ]; then
        echo "tlt: stopped on USR1 and checkpointed" >&2
        tlt_requeue
    fi
    return "$rc"
}

# The run is checkpointed: put the job back in the queue, where it resumes with
# resume=true. SLURM refuses a job submitted without --requeue (or on a cluster with
# JobRequeue=0); the job then ends here with 130 and is resumed by resubmitting it with
# resume=true. After a successful requeue SLURM ends this shell itself.
tlt_requeue() {
    local why
    if why=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        echo "tlt: requeued job $SLURM_JOB_ID; it resumes with resume=true when it starts again" >&2
        # SLURM ends this shell with the requeue; wait for it rather than report a failure
        sleep 60
        return 0
    fi
    echo "tlt: job $SLURM_JOB_ID cannot be requeued (${why:-scontrol requeue failed}; submit with --requeue):" \
        "resubmit it with resume=true to continue" >&2
    return 1
}
