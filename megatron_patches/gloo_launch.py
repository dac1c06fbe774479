"""Run a function on N CPU processes joined by a gloo process group.

Contract: ``run_gloo(fn, world_size, *args, timeout_s=..., hide_cuda=True)``
spawns ``world_size`` fresh processes, initialises ``torch.distributed`` with
gloo (file rendezvous, so no port is raced), calls ``fn(rank, world_size, *args)``
and returns the per-rank return values (which must be picklable). If any
rank raises, the others are terminated and a RuntimeError carrying that rank's
traceback is raised; if the deadline passes, every process is killed and a
TimeoutError is raised. Nothing is left running either way.

The children are CPU processes: by default they start with
``CUDA_VISIBLE_DEVICES=""`` in their environment (set from exec on, so before
they import torch), which makes ``torch.cuda.is_available()`` false in them
and lets ``megatron_patches.cpu_shims`` run there on a GPU host too. The
parent's environment carries the setting only while the children start and is
restored at once. ``hide_cuda=False`` passes the parent's GPU visibility through.

Used by tests, the CPU conversion tool and the reshard benchmark; on a cluster
the job launcher (torchrun / SLURM) creates the process group instead.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp


def _child(rank: int, world: int, init_file: str, fn: Callable, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    # Each rank gets one intra-op thread: the test machines are small and oversubscribing
    # cores with world_size x num_cores threads makes gloo runs crawl.
    torch.set_num_threads(int(os.environ.get("NEMO_TLT_GLOO_THREADS", "1")))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        # Tensors sent through a multiprocessing queue travel as shared-memory file descriptors
        # that die with this process; plain bytes survive it.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report every failure (incl. SystemExit) to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _spawn_environment(hide_cuda: bool) -> Iterator[None]:
    """The environment spawned children inherit at exec: CUDA hidden if asked, restored after.

    Setting the variable inside the child would come too late: the spawn bootstrap
    imports the parent's main module (and with it torch) before ``fn`` runs.
    """
    if not hide_cuda:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def run_gloo(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0,
             hide_cuda: bool = True) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"run_gloo: world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="nemo_tlt_gloo_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(r, world_size, init_file, fn, args, results), daemon=False)
                 for r in range(world_size)]
        with _spawn_environment(hide_cuda):
            for p in procs:
                p.start()
        ok = False
        try:
            values = _collect(procs, results, world_size, time.monotonic() + timeout_s, timeout_s)
            ok = True
            return values
        finally:
            # After a failure the other ranks may be blocked in a collective forever: kill at once.
            _reap(procs, grace_s=30.0 if ok else 0.0)


def _collect(procs: list, results: Any, world: int, deadline: float, timeout_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < world:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"run_gloo: ranks {sorted(set(range(world)) - set(values))} "
                               f"did not finish within {timeout_s:.0f}s")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and i not in values]
            if dead:
                # Give a dying rank a moment to flush its traceback through the queue.
                try:
                    rank, ok, value = results.get(timeout=2.0)
                except queue.Empty:
                    raise RuntimeError(f"run_gloo: rank {dead[0]} died with exit code "
                                       f"{procs[dead[0]].exitcode} and no traceback") from None
            else:
                continue
        if not ok:
            raise RuntimeError(f"run_gloo: rank {rank} failed:\n{value}")
        # Full pickle is safe here: these bytes were written by torch.save in a child this function
        # spawned, handed over a private queue, never read from a file or another program; and
        # fn may return any picklable object, which weights_only=True would refuse.
        values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [values[r] for r in range(world)]


def _reap(procs: list, grace_s: float = 30.0) -> None:
    """Let ranks exit on their own first: a killed rank cannot run its exit handlers, which
    would orphan helper processes it started (megatron's checkpoint writer starts some)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
