"""Start N local processes joined by one process group; return what each returns.

Contract
--------
``launch_local(fn, world_size, *args, ...)`` calls ``fn(ctx, *args)`` once per rank and
returns the ranks' return values in rank order (picklable values; tensors arrive intact).
``ctx`` is a ``RankContext``: ``rank``, ``world``, ``local_rank``, ``device`` (the
``torch.device`` the rank computes on), ``store`` (the rendezvous ``TCPStore``, a
key-value channel every rank shares) and ``stop`` (a ``StopFlag``).

* Device (``device``: a ``workers.device`` kind, ``cpu`` by default): every rank binds
  ``resolve_device(kind, local_rank)``; a CUDA rank calls ``torch.cuda.set_device``
  before it joins, so NCCL and every tensor made without a device land on its own GPU.
  The whole launch is checked in the launcher before any rank starts (``cuda`` without
  CUDA, more local ranks than GPUs: ``ValueError`` naming ``workers.device``).
* Process group (``join``): CPU ranks join a plain gloo group. CUDA ranks join one
  group with two backends, ``"cpu:gloo,cuda:nccl"``, bound to their device
  (``device_id``): torch dispatches each collective by the device of its tensors, so
  CUDA tensors go over NCCL and CPU tensors over gloo; object collectives
  (``all_gather_object``, ``broadcast_object_list``) pickle to a CPU tensor, because
  ``_get_object_coll_device`` picks ``cpu`` whenever the group has a CPU backend; the
  barrier runs on the bound device. So no separate gloo group is made (it would be one
  more collective ``new_group`` every rank must call in the same order, and every
  object call would have to name it), and ``new_group`` without a backend (the node
  groups) inherits both backends.
* Rendezvous: the launcher hosts the ``TCPStore`` itself, once every rank has started
  (no rank is ever forked while the store's server thread runs), on a port the OS picks
  (no port is raced), and sends each rank the port over a pipe; each rank connects to
  it and joins the group over it, with ``collective_timeout_s`` as the store's and the
  group's timeout.
* ``hide_cuda=True``: the children start with ``CUDA_VISIBLE_DEVICES=""`` (set from exec
  on, so before they import torch): CPU processes on a GPU host, where megatron's CPU
  shims may run; ``auto`` then means ``cpu`` and ``cuda`` is refused. The launcher's
  environment is restored at once.
* ``threads``: torch intra-op threads of every rank.
* A failing rank is never silent: its traceback reaches the launcher, which stops the
  other ranks and raises ``RuntimeError("rank R failed: ...")``; a rank that dies
  without a word raises naming the rank and exit code. ``timeout_s`` bounds the whole
  run (``TimeoutError`` naming the ranks that did not finish; None: no bound).
  Nothing is left running either way.
* Logging: each rank configures logging (``logging.basicConfig``; a record reads
  ``... rank R name: message``) with ``nemo_tlt``'s loggers at the launcher's level and other
  libraries' at WARNING or above, so a rank's INFO lines reach the launcher's stderr as its
  own do (a spawned process starts unconfigured, where they are dropped).
* ``forward_signals=True``: SIGINT / SIGTERM sent to the launcher set a shared event
  every rank's ``ctx.stop`` reads (installed as the ranks' signal handler too), so the
  ranks stop at a boundary of their choosing instead of dying mid-step.
* ``in_process=True`` with ``world_size == 1``: ``fn`` runs in the calling process with
  a ``HashStore`` and no process group, on its resolved device (the caller's torch
  thread count is restored).

A cluster launch (``nemo_tlt.dist.slurm.launch_slurm``: rank / world / local rank / node
from SLURM's variables, the store at the first host of the node list, hosted by rank 0;
``nemo_tlt.dist.torchrun.launch_torchrun``: torchrun's variables and store) is one more
producer of a ``Rendezvous`` handed to ``run_rank``; the ranks' side is the same.

GPU paths (NCCL, ``set_device``) are written to torch's documented contract and tested on
a simulated CUDA host only; they have not been run on a GPU.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import queue
import signal
import socket
import time
import traceback
from unittest import mock
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_tlt.dist.comm import SIGNALS, StopFlag
from nemo_tlt.device import resolve_device

CPU_BACKEND = "gloo"
CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # one group: CUDA tensors over NCCL, CPU tensors and objects over gloo


def free_port() -> int:
    """A free TCP port on localhost (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Rendezvous:
    """Where rank ``rank`` of ``world`` meets the others: the TCPStore at ``host:port``
    (hosted by this rank when ``host_store``)."""

    host: str
    port: int
    rank: int
    world: int
    local_rank: int
    host_store: bool = False
    node: int = 0  # index of this rank's node (0 for a local launch)


@dataclass
class RankContext:
    rank: int
    world: int
    local_rank: int
    store: Any  # torch.distributed.Store
    stop: StopFlag
    node: int = 0  # index of this rank's node: ranks with equal `node` share a host
    device: torch.device = torch.device("cpu")  # bound by the launcher (cuda:LOCAL_RANK or cpu)


def bind_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device; a CUDA device becomes the current one (before any group exists)."""
    device = resolve_device(kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def process_group_backend(device: torch.device) -> str:
    return CUDA_BACKEND if device.type == "cuda" else CPU_BACKEND


def join(rdzv: Rendezvous, timeout_s: float, device: torch.device = torch.device("cpu"),
         store: dist.Store | None = None) -> dist.Store:
    """Join the process group of `device` (see the module docstring) over the rendezvous
    store: `store` when given (torchrun: the launch's part of the agent's store), else the
    ``TCPStore`` at ``rdzv.host:rdzv.port`` (hosted here when ``rdzv.host_store``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(rdzv.host, rdzv.port, rdzv.world, rdzv.host_store, timeout, wait_for_workers=False)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(process_group_backend(device), store=dist.PrefixStore("pg", store), rank=rdzv.rank,
                            world_size=rdzv.world, timeout=timeout, **bound)
    return store


def run_rank(fn: Callable, rdzv: Rendezvous, args: tuple, *, timeout_s: float, threads: int,
             device: str = "cpu", stop_event: Any = None, install_signals: bool = False,
             store: dist.Store | None = None) -> Any:
    """One rank's whole life: threads, device, rendezvous, ``fn(ctx, *args)``, leave the group.

    `device` is a ``workers.device`` kind, resolved with this rank's local rank."""
    torch.set_num_threads(threads)
    stop = StopFlag(stop_event)
    if install_signals:
        stop.install()
    try:
        bound = bind_device(device, rdzv.local_rank)
        store = join(rdzv, timeout_s, bound, store)
        value = fn(RankContext(rdzv.rank, rdzv.world, rdzv.local_rank, store, stop, rdzv.node, bound), *args)
        # Only after success: a failing rank reports first and leaves its peers blocked, not
        # reset (a reset would make a peer's error race the real one to the launcher).
        _leave(store, rdzv, timeout_s)
        return value
    finally:
        stop.restore()  # a SLURM task outlives its rank: later signals act as usual again


def _leave(store: Any, rdzv: Rendezvous, timeout_s: float) -> None:
    """Leave together: every rank waits until all have finished (rank 0 may still be
    writing its final checkpoint), and the rank hosting the store (SLURM mode: rank 0)
    keeps it up until every other rank has left the group: a peer whose store or group
    vanishes under it while it tears down can abort the process."""
    dist.barrier()
    dist.destroy_process_group()
    if rdzv.world > 1:
        store.add("tlt/left", 1)
        if rdzv.host_store:  # the others must not poll: the store ends with the host's launch
            deadline = time.monotonic() + timeout_s
            while int(store.add("tlt/left", 0)) < rdzv.world and time.monotonic() < deadline:
                time.sleep(0.01)


def _child(rdzv: Rendezvous, port: Any, fn: Callable, args: tuple, results: Any, timeout_s: float, threads: int,
           device: str, stop_event: Any, install_signals: bool, log_level: int) -> None:
    # a spawned rank starts with logging unconfigured (INFO records dropped): nemo_tlt's records at the
    # launcher's level, other libraries' at WARNING (megatron-core lists every bucket's parameters at INFO)
    logging.basicConfig(level=max(log_level, logging.WARNING),
                        format=f"%(asctime)s %(levelname)s rank {rdzv.rank} %(name)s: %(message)s")
    logging.getLogger("nemo_tlt").setLevel(log_level)
    try:
        rdzv = replace(rdzv, port=port.recv())  # the launcher opens its store once every rank has started
        value = run_rank(fn, rdzv, args, timeout_s=timeout_s, threads=threads, device=device,
                         stop_event=stop_event, install_signals=install_signals)
        # Tensors sent through a multiprocessing queue travel as shared-memory file
        # descriptors that die with this process; plain bytes survive it.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rdzv.rank, True, buf.getvalue()))
    except BaseException:  # report every failure (incl. SystemExit) to the launcher, then exit non-zero
        results.put((rdzv.rank, False, traceback.format_exc()))
        raise


def launch_local(fn: Callable, world_size: int, *args: Any, timeout_s: float | None = 300.0,
                 collective_timeout_s: float = 300.0, threads: int = 1, hide_cuda: bool = True,
                 start_method: str = "spawn", forward_signals: bool = False, in_process: bool = False,
                 device: str = "cpu") -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` local ranks; their return values in rank order."""
    if world_size < 1:
        raise ValueError(f"launch_local: world_size must be >= 1, got {world_size}")
    in_proc = in_process and world_size == 1
    device = local_device_kind(device, world_size, hide_cuda and not in_proc, None if in_proc else start_method)
    if in_process and world_size == 1:
        return [_run_in_process(fn, args, threads, forward_signals, device)]
    ctx = mp.get_context(start_method)
    results, stop_event = ctx.Queue(), ctx.Event()
    ports = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (reader, writer) per rank
    procs = [ctx.Process(target=_child, name=f"tlt-rank-{r}",
                         args=(Rendezvous("127.0.0.1", 0, r, world_size, r), ports[r][0], fn, args, results,
                               collective_timeout_s, threads, device, stop_event, forward_signals,
                               logging.getLogger().getEffectiveLevel()))
             for r in range(world_size)]
    forwarded = _forward_signals(stop_event) if forward_signals else {}
    ok, store = False, None
    try:
        with _spawn_environment(hide_cuda):
            for p in procs:
                p.start()
        # Only now: the store's server thread must not exist while the ranks are forked
        # (start_method="fork" copies the launcher with that thread's locks as they are;
        # a lock it held mid-request stays held for ever in the child). See _host_store.
        store = _host_store(world_size, collective_timeout_s)
        for _, writer in ports:
            writer.send(store.port)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        values = _collect(procs, results, world_size, deadline, timeout_s)
        ok = True
        return values
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        # After a failure the other ranks may be blocked in a collective forever: kill at once.
        _reap(procs, grace_s=30.0 if ok else 0.0)
        del store


def _host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The launch's rendezvous store on a port the OS picks (no port is raced).

    Hosted after the ranks have started, never before: a ``TCPStore`` server runs a
    thread (``pt_tcpstore_uv``) that serves every rank's requests, and ``fork`` copies only
    the calling thread, so a rank forked while that thread holds a lock (serving the
    ranks forked before it) inherits the lock held, with no thread to release it, and
    hangs on its first use of it: no timeout applies, and the launch waits until its own
    ``timeout_s`` ends."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def local_device_kind(kind: str, world_size: int, hide_cuda: bool, start_method: str | None = None) -> str:
    """The device kind local ranks 0..world_size-1 run with (``cpu`` or ``cuda``), checked
    in the launcher: a wrong ``workers.device`` fails before any rank starts. Ranks that
    ``start_method="fork"`` would start cannot use CUDA (a forked child of a process that
    touched CUDA cannot initialise it), nor can they be hidden from a host's GPUs (a forked
    child keeps the launcher's view of CUDA, whatever ``CUDA_VISIBLE_DEVICES`` says): CUDA is
    probed through NVML then, without initialising it here, and a fork launch that would
    compute on CUDA, or hide it, is refused."""
    if start_method == "fork" and hide_cuda:
        with _nvml_cuda_check():
            if torch.cuda.is_available():
                raise ValueError("start_method=fork cannot hide this host's GPUs from the ranks (a forked rank keeps "
                                 "the launcher's view of CUDA, whatever CUDA_VISIBLE_DEVICES says); use "
                                 "start_method=spawn")
    if start_method == "fork" and not hide_cuda and kind != "cpu":
        with _nvml_cuda_check():
            if kind == "cuda" or torch.cuda.is_available():
                raise ValueError(f"workers.device={kind} resolves to CUDA, which forked ranks cannot use "
                                 "(workers.start_method=fork); use workers.start_method=spawn, or workers.device=cpu")
    if hide_cuda:
        if kind == "cuda":
            raise ValueError("workers.device=cuda, but this launch hides CUDA from its ranks (hide_cuda=True: "
                             "CUDA_VISIBLE_DEVICES=\"\"); use workers.device=cpu or auto")
        return resolve_device(kind, 0, cuda_available=False).type
    resolve_device(kind, world_size - 1)  # every local rank has a GPU of its own
    return resolve_device(kind, 0).type


def _nvml_cuda_check() -> contextlib.AbstractContextManager:
    """``torch.cuda.is_available()`` through NVML (no CUDA initialisation: fork stays safe)."""
    return mock.patch.dict(os.environ, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"})


def _run_in_process(fn: Callable, args: tuple, threads: int, install_signals: bool, device: str) -> Any:
    stop = StopFlag()
    if install_signals:
        stop.install()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(RankContext(0, 1, 0, dist.HashStore(), stop, 0, bind_device(device, 0)), *args)
    finally:
        torch.set_num_threads(before)
        stop.restore()


def _forward_signals(stop_event: Any) -> dict[int, Any]:
    """The launcher's SIGINT/SIGTERM reach the ranks through `stop_event` (a signal sent
    to a rank still importing torch would kill it or be ignored)."""
    def forward(signum: int, frame: Any) -> None:
        stop_event.set()

    return {sig: signal.signal(sig, forward) for sig in SIGNALS}


@contextlib.contextmanager
def _spawn_environment(hide_cuda: bool) -> Iterator[None]:
    """The environment the children inherit at exec: CUDA hidden if asked, restored after.

    Setting the variable inside the child would come too late: the spawn bootstrap
    imports the parent's main module (and with it torch) before ``fn`` runs.
    """
    if not hide_cuda:
        yield
        return
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
        yield


def _collect(procs: list, results: Any, world: int, deadline: float | None, timeout_s: float | None) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < world:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"launch_local: ranks {sorted(set(range(world)) - set(values))} "
                               f"did not finish within {timeout_s:.0f}s")
        try:
            rank, ok, value = results.get(timeout=1.0 if remaining is None else min(remaining, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and i not in values]
            if not dead:
                continue
            try:  # give a dying rank a moment to flush its traceback through the queue
                rank, ok, value = results.get(timeout=2.0)
            except queue.Empty:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before "
                                   "reporting (killed? out of memory?)") from None
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        # Full pickle is safe here: these bytes were written by torch.save in a child this
        # launcher started, over a private queue; fn may return any picklable object.
        values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [values[r] for r in range(world)]


def _reap(procs: list, grace_s: float) -> None:
    """Let ranks exit on their own first: a killed rank cannot run its exit handlers, which
    would orphan helper processes it started (megatron's checkpoint writer starts some)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
