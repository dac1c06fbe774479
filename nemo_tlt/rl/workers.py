"""Data-parallel RL worker processes: one RL run on ``workers.num_workers`` ranks.

Contract
--------
* ``launch_mode(workers, env)``: ``"local"``, ``"slurm"``, ``"torchrun"`` (or the name of
  another cluster launcher: ``nemo_tlt.dist.launchers.LAUNCHERS``) from
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

from nemo_tlt.device import resolve_device
from nemo_tlt.dist import Comm, RankContext, StopFlag, launch_local
from nemo_tlt.dist.launch import local_device_kind
from nemo_tlt.dist.launchers import choose_launcher

RunFn = Callable[[Any, Comm, StopFlag, Callable | None], dict]


def launch_mode(workers: Any, env: Mapping[str, str] | None = None) -> str:
    """``"local"`` or the name of the cluster launcher (``nemo_tlt.dist.launchers``) this process
    runs `workers` under (see the module docstring)."""
    found = choose_launcher(workers.launcher, workers.num_workers, env)
    return "local" if found is None else found.name


def process_rank(workers: Any, env: Mapping[str, str] | None = None) -> int:
    """This process's rank in the launch: its task's (SLURM_PROCID, RANK, ...), or 0 locally."""
    env = os.environ if env is None else env
    found = choose_launcher(workers.launcher, workers.num_workers, env)
    return 0 if found is None else found.task(env).rank


def resolved_workers(workers: Any, env: Mapping[str, str] | None = None) -> Any:
    """`workers` with the launcher and device kind this process runs (see the module docstring)."""
    env = os.environ if env is None else env
    found = choose_launcher(workers.launcher, workers.num_workers, env)
    if found is None:
        start = workers.start_method if workers.num_workers > 1 else None  # one worker runs in this process
        kind = local_device_kind(workers.device, workers.num_workers, hide_cuda=False, start_method=start)
        return replace(workers, launcher="local", device=kind)
    kind = resolve_device(workers.device, found.task(env).local_rank).type
    return replace(workers, launcher=found.name, device=kind)


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
    found = choose_launcher(workers.launcher, workers.num_workers)
    if found is not None:
        return found.launch(_task_main, workers.num_workers, spec, run, on_step, device=workers.device,
                            collective_timeout_s=workers.timeout_s, threads=workers.threads_per_worker)
    summaries = launch_local(
        _rank_main, workers.num_workers, spec, run, on_step, timeout_s=None,
        collective_timeout_s=workers.timeout_s, threads=workers.threads_per_worker,
        hide_cuda=False, start_method=workers.start_method, forward_signals=True,
        in_process=True, device=workers.device)
    return summaries[0]
