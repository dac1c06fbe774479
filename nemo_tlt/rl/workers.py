"""Data-parallel RL worker processes: one RL run on ``workers.num_workers`` ranks.

Contract
--------
* ``launch_mode(workers, env)``: ``"local"``, ``"slurm"`` or ``"torchrun"`` from
  ``workers.launcher`` and the environment (``auto``: ``torchrun`` when torchrun's
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are all set,
  else ``slurm`` inside an srun step of more than one task, else ``local``).
  ``launcher=local`` inside such a step, or under torchrun with ``WORLD_SIZE`` > 1, is
  refused (every process would start its own copy of the run); ``launcher=slurm`` /
  ``torchrun`` outside their environment is refused naming the missing variables.
  ``process_rank(workers, env)`` is this process's rank in the launch (``SLURM_PROCID``,
  ``RANK``, or 0 for ``local``): the process that prints and writes the run's reports.
* ``resolved_workers(workers, env)``: `workers` with ``launcher`` and ``device`` as this
  process will run them (never ``auto``: what a run records in its ``config.yaml``),
  checked before any work: ``device=cuda`` without CUDA, or more ranks on this node than
  GPUs, raises ``ValueError`` naming ``workers.device``.
* ``launch(spec, run, on_step=None)`` runs ``run(spec, comm, stop_flag, on_step)`` on
  every rank and returns rank 0's summary (in SLURM mode on every task).
  - local: through ``nemo_tlt.dist.launch_local``. One worker runs in the calling
    process (a ``HashStore``, no process group); more run as processes
    (``workers.start_method``) joined by gloo over the launcher's ``TCPStore``, which
    also carries the BUSY/IDLE/TRAINING coordinator.
  - slurm: this process is rank ``SLURM_PROCID`` of ``SLURM_NTASKS``, through
    ``nemo_tlt.dist.launch_slurm`` (the store is hosted by rank 0 at the job's first
    node); a task count other than ``workers.num_workers`` is refused naming both.
  - torchrun: this process is rank ``RANK`` of ``WORLD_SIZE``, through
    ``nemo_tlt.dist.launch_torchrun`` (torchrun's store, one key prefix per launch); a
    world other than ``workers.num_workers`` is refused naming both.
  Every rank computes on ``resolve_device(workers.device, local_rank)`` (``Comm.device``):
  ``cuda:LOCAL_RANK`` with NCCL for CUDA tensors and gloo for objects, or the CPU.
  Every worker computes with ``workers.threads_per_worker`` torch threads (the single
  in-process worker too; the caller's thread count is restored afterwards);
  collectives time out after ``workers.timeout_s``.
* SIGINT / SIGTERM never kill a worker mid-step: the local launcher forwards them to
  every rank's ``StopFlag`` (``srun`` forwards them to its tasks); the ranks agree at
  the next step boundary (``Comm.any``), rank 0 checkpoints and every rank exits cleanly.
* A failing worker is never silent: locally its traceback reaches the caller, the other
  workers are stopped, and ``RuntimeError`` names the rank; under SLURM the task fails
  with its traceback and ``srun --kill-on-bad-exit=1`` ends the step.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch.distributed as dist

from nemo_tlt.dist import (Comm, RankContext, SlurmEnvError, StopFlag, in_srun_step, in_torchrun, launch_local,
                           launch_slurm, launch_torchrun)
from nemo_tlt.device import resolve_device
from nemo_tlt.dist.launch import local_device_kind
from nemo_tlt.dist.slurm import SlurmTask
from nemo_tlt.dist.torchrun import TorchrunEnvError, TorchrunTask

RunFn = Callable[[Any, Comm, StopFlag, Callable | None], dict]


def _srun_tasks(env: Mapping[str, str]) -> int:
    if not in_srun_step(env):
        return 0
    try:
        return int(env.get("SLURM_NTASKS", "1"))
    except ValueError:
        raise SlurmEnvError(f"SLURM_NTASKS={env['SLURM_NTASKS']!r} is not an integer") from None


def launch_mode(workers: Any, env: Mapping[str, str] | None = None) -> str:
    """``"local"``, ``"slurm"`` or ``"torchrun"``: how this process runs `workers` (see the
    module docstring)."""
    env = os.environ if env is None else env
    if workers.launcher == "torchrun" or (workers.launcher == "auto" and in_torchrun(env)):
        TorchrunTask.from_env(env)  # names what is missing
        return "torchrun"
    tasks = _srun_tasks(env)
    if workers.launcher == "slurm" or (workers.launcher == "auto" and tasks > 1):
        SlurmTask.from_env(env)  # names what is missing
        return "slurm"
    if tasks > 1:
        raise SlurmEnvError(f"workers.launcher=local, but this process is task {env.get('SLURM_PROCID')} of "
                            f"SLURM_NTASKS={tasks} srun tasks: each would start its own run of "
                            f"{workers.num_workers} workers; set workers.launcher=slurm (or auto), or start "
                            "one task")
    if workers.launcher == "local" and in_torchrun(env) and TorchrunTask.from_env(env).world > 1:
        raise TorchrunEnvError(f"workers.launcher=local, but this process is torchrun worker {env['RANK']} of "
                               f"WORLD_SIZE={env['WORLD_SIZE']}: each would start its own run of "
                               f"{workers.num_workers} workers; set workers.launcher=torchrun (or auto), or start "
                               "one torchrun worker")
    return "local"


def process_rank(workers: Any, env: Mapping[str, str] | None = None) -> int:
    """This process's rank in the launch: SLURM_PROCID or RANK in those modes, else 0."""
    env = os.environ if env is None else env
    mode = launch_mode(workers, env)
    if mode == "slurm":
        return SlurmTask.from_env(env).rank
    return TorchrunTask.from_env(env).rank if mode == "torchrun" else 0


def resolved_workers(workers: Any, env: Mapping[str, str] | None = None) -> Any:
    """`workers` with the launcher and device kind this process runs (see the module docstring)."""
    env = os.environ if env is None else env
    mode = launch_mode(workers, env)
    if mode == "local":
        start = workers.start_method if workers.num_workers > 1 else None  # one worker runs in this process
        kind = local_device_kind(workers.device, workers.num_workers, hide_cuda=False, start_method=start)
    else:
        local_rank = (SlurmTask.from_env(env) if mode == "slurm" else TorchrunTask.from_env(env)).local_rank
        kind = resolve_device(workers.device, local_rank).type
    return replace(workers, launcher=mode, device=kind)


def _comm(ctx: RankContext) -> Comm:
    return Comm(ctx.rank, ctx.world, ctx.store, ctx.node, device=ctx.device)


def _rank_main(ctx: RankContext, spec: Any, run: RunFn, on_step: Callable | None) -> dict | None:
    summary = run(spec, _comm(ctx), ctx.stop, on_step)
    return summary if ctx.rank == 0 else None


def _task_main(ctx: RankContext, spec: Any, run: RunFn, on_step: Callable | None) -> dict:
    """One SLURM task or torchrun worker: every one leaves with rank 0's summary (one
    report, one status)."""
    summary = [run(spec, _comm(ctx), ctx.stop, on_step)]
    if ctx.world > 1:
        dist.broadcast_object_list(summary, src=0)
    return summary[0]


def launch(spec: Any, run: RunFn, on_step: Callable | None = None) -> dict:
    """Run `run(spec, comm, stop_flag, on_step)` on every rank; returns rank 0's summary.

    `on_step(step, record)` is called by every rank after each RL step (a hook for
    tests, e.g. to raise a signal after step k; it must pickle under 'spawn')."""
    workers = spec.config.workers
    mode = launch_mode(workers)
    if mode != "local":
        cluster_launch = launch_slurm if mode == "slurm" else launch_torchrun
        return cluster_launch(_task_main, workers.num_workers, spec, run, on_step, device=workers.device,
                              collective_timeout_s=workers.timeout_s, threads=workers.threads_per_worker)
    summaries = launch_local(
        _rank_main, workers.num_workers, spec, run, on_step, timeout_s=None,
        collective_timeout_s=workers.timeout_s, threads=workers.threads_per_worker,
        hide_cuda=False, start_method=workers.start_method, forward_signals=True,
        in_process=True, device=workers.device)
    return summaries[0]
