"""The server behind megatron-core's write-results queue: dying with the rank that starts it,
and holding the results as pickled bytes.

Contract: ``results_queue_dying_with_rank()`` -> ``PickledQueue``, a queue served by a spawned
``multiprocessing`` manager process. ``put(obj)`` pickles ``obj`` in the caller and the server
stores the bytes; ``get`` / ``get_nowait`` unpickle in the caller. So the server never unpickles
megatron-core's ``WriteResult`` objects and need not import torch: it starts and serves with the
interpreter alone, about 2 s of CPU less per rank and save than megatron-core's own spawned
manager, which imports torch to unpickle the first results. (A spawned process re-imports its
parent's main module: under a script that imports torch at its top the server still does.)
The kernel kills the server when the rank that started it dies (Linux ``PR_SET_PDEATHSIG``), so
a rank killed mid-save leaves no server behind. This module imports no torch and no megatron-core: the spawned server imports
it to find its initializer.
"""
from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.managers import SyncManager


def _die_with_parent() -> None:
    """In the results-queue server: be killed when the rank that started it dies (Linux prctl)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class PickledQueue:
    """A manager queue proxy whose items cross the server as pickled bytes (what megatron-core's
    writers and finalize call: ``put``, ``get``, ``get_nowait``, ``empty``, ``qsize``). It pickles
    as its proxy does, so a writer process receives it like the proxy; ``shutdown()`` stops the
    server (the process that started it only)."""

    def __init__(self, proxy, manager: SyncManager | None = None) -> None:
        self._proxy, self._manager = proxy, manager

    def __getstate__(self) -> dict:
        return {"_proxy": self._proxy, "_manager": None}  # a manager is its starter's alone

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        self._proxy.put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), block, timeout)

    def get(self, block: bool = True, timeout: float | None = None):
        return pickle.loads(self._proxy.get(block, timeout))

    def get_nowait(self):
        return pickle.loads(self._proxy.get_nowait())

    def empty(self) -> bool:
        return self._proxy.empty()

    def qsize(self) -> int:
        return self._proxy.qsize()

    @property
    def server_pid(self) -> int | None:
        return None if self._manager is None else self._manager._process.pid

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()


def results_queue_dying_with_rank() -> PickledQueue:
    """A ``PickledQueue`` whose server the kernel kills when the calling process dies (see the
    module docstring)."""
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    return PickledQueue(manager.Queue(), manager)
