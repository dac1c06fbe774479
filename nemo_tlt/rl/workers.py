"""Data-parallel RL worker processes: launch, collectives, signals.

Contract
--------
* ``launch(spec)`` runs one RL run (``nemo_tlt.rl.loop``) on
  ``config.workers.num_workers`` ranks and returns rank 0's summary. One worker runs
  in the calling process (a ``HashStore``, no process group); more run as processes
  (``workers.start_method``) joined by a gloo process group over a ``TCPStore`` that
  rank 0 hosts; the same store carries the BUSY/IDLE/TRAINING coordinator. Every
  worker computes with ``workers.threads_per_worker`` torch threads (the single
  in-process worker too; the caller's thread count is restored afterwards).
* ``Comm`` is the only distributed surface the loop sees: typed collectives that
  are no-ops for a single rank. Gradient all-reduce goes through one flat float32
  buffer, so every rank receives the same bits and the replicas stay identical.
* SIGINT / SIGTERM never kill a worker mid-step: ``StopFlag`` records the signal,
  the ranks agree at the next step boundary (``Comm.any``), rank 0 checkpoints and
  every rank exits cleanly. The parent passes the signals it receives to its
  workers through a shared event (a ``kill`` of the parent alone reaches everyone,
  even a worker that is still starting up).
* A failing worker is never silent: its traceback reaches the parent, which stops
  the other workers and raises ``RuntimeError`` naming the rank.
"""
from __future__ import annotations

import datetime
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_tlt.spot.coordinator import free_port

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Set by SIGINT/SIGTERM (or `request`), or by the launcher through a shared
    `event` (so a signal that reached the launcher while a worker was still starting
    up is not lost); read at step boundaries."""

    def __init__(self, event: Any = None) -> None:
        self.signum: int | None = None
        self.event = event
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None or (self.event is not None and self.event.is_set())

    def request(self, signum: int = signal.SIGTERM) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> "StopFlag":
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self.request(signum))
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class Comm:
    """Collectives of one rank; trivial when ``world == 1``."""

    rank: int
    world: int
    store: dist.Store

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0])
        if self.distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def allreduce_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Sum gradients over ranks in one flat float32 buffer (identical bits on every rank)."""
        if not self.distributed:
            return
        present = [g for g in grads if g is not None]
        flat = torch.cat([g.detach().float().reshape(-1) for g in present])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in present:
            n = g.numel()
            g.copy_(flat[offset: offset + n].view_as(g))
            offset += n


RunFn = Callable[[Any, Comm, StopFlag, Callable | None], dict]


def _worker_entry(rank: int, world: int, port: int, spec: Any, run: RunFn, on_step: Callable | None,
                  results: Any, stop_event: Any) -> None:
    flag = StopFlag(stop_event).install()
    try:
        torch.set_num_threads(spec.config.workers.threads_per_worker)
        timeout = datetime.timedelta(seconds=spec.config.workers.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timeout)
        summary = run(spec, Comm(rank, world, store), flag, on_step)
        results.put({"rank": rank, "summary": summary if rank == 0 else None})
        dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, then die with it
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def launch(spec: Any, run: RunFn, on_step: Callable | None = None) -> dict:
    """Run `run(spec, comm, stop_flag, on_step)` on every rank; returns rank 0's summary.

    `on_step(step, record)` is called by every rank after each RL step (a hook for
    tests, e.g. to raise a signal after step k; it must pickle under 'spawn')."""
    world = spec.config.workers.num_workers
    if world == 1:
        flag = StopFlag().install()
        threads = torch.get_num_threads()
        torch.set_num_threads(spec.config.workers.threads_per_worker)
        try:
            return run(spec, Comm(0, 1, dist.HashStore()), flag, on_step)
        finally:
            torch.set_num_threads(threads)
            flag.restore()
    ctx = mp.get_context(spec.config.workers.start_method)
    results, stop_event = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker_entry, args=(r, world, port, spec, run, on_step, results, stop_event),
                         name=f"tlt-worker-{r}") for r in range(world)]
    forwarded = _forward_signals(stop_event)
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world)
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _forward_signals(stop_event: Any) -> dict[int, Any]:
    """The launcher's SIGINT/SIGTERM reach the workers through `stop_event` (a signal
    sent to a worker still importing torch would kill it or be ignored)."""
    def forward(signum: int, frame: Any) -> None:
        stop_event.set()

    return {sig: signal.signal(sig, forward) for sig in _SIGNALS}


def _collect(procs: list, results: Any, world: int) -> dict:
    """Wait for every rank's report; a failure or a dead worker stops the run loudly.
    (A hung worker is not waited on forever: its collectives time out after
    workers.timeout_s and it reports the error.)"""
    summary, done = None, set()
    while len(done) < world:
        try:
            item = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"RL worker {dead[0].name} died with exit code {dead[0].exitcode} "
                                   "before reporting (killed? out of memory?)") from None
            continue
        if "error" in item:
            raise RuntimeError(f"RL worker rank {item['rank']} failed:\n{item['error']}")
        done.add(item["rank"])
        if item["rank"] == 0:
            summary = item["summary"]
    for p in procs:
        p.join(timeout=60)
    assert summary is not None
    return summary
