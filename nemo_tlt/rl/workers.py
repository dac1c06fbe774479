"""Data-parallel RL worker processes: one RL run on ``workers.num_workers`` ranks.

Contract
--------
* ``launch(spec, run, on_step=None)`` runs ``run(spec, comm, stop_flag, on_step)`` on
  every rank through ``nemo_tlt.dist.launch_local`` and returns rank 0's summary. One
  worker runs in the calling process (a ``HashStore``, no process group); more run as
  processes (``workers.start_method``) joined by gloo over the launcher's ``TCPStore``,
  which also carries the BUSY/IDLE/TRAINING coordinator. Every worker computes with
  ``workers.threads_per_worker`` torch threads (the single in-process worker too; the
  caller's thread count is restored afterwards); collectives time out after
  ``workers.timeout_s``.
* SIGINT / SIGTERM never kill a worker mid-step: the launcher forwards them to every
  rank's ``StopFlag``; the ranks agree at the next step boundary (``Comm.any``), rank 0
  checkpoints and every rank exits cleanly.
* A failing worker is never silent: its traceback reaches the caller, the other workers
  are stopped, and ``RuntimeError`` names the rank.
"""
from __future__ import annotations

from typing import Any, Callable

from nemo_tlt.dist import Comm, RankContext, StopFlag, launch_local

RunFn = Callable[[Any, Comm, StopFlag, Callable | None], dict]


def _rank_main(ctx: RankContext, spec: Any, run: RunFn, on_step: Callable | None) -> dict | None:
    summary = run(spec, Comm(ctx.rank, ctx.world, ctx.store), ctx.stop, on_step)
    return summary if ctx.rank == 0 else None


def launch(spec: Any, run: RunFn, on_step: Callable | None = None) -> dict:
    """Run `run(spec, comm, stop_flag, on_step)` on every rank; returns rank 0's summary.

    `on_step(step, record)` is called by every rank after each RL step (a hook for
    tests, e.g. to raise a signal after step k; it must pickle under 'spawn')."""
    workers = spec.config.workers
    summaries = launch_local(
        _rank_main, workers.num_workers, spec, run, on_step, timeout_s=None,
        collective_timeout_s=workers.timeout_s, threads=workers.threads_per_worker,
        hide_cuda=False, start_method=workers.start_method, forward_signals=True,
        in_process=True)
    return summaries[0]
