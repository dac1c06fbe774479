"""The server behind megatron-core's write-results queue, dying with the rank that starts it.

This module imports no torch and no megatron-core: the server is a spawned process that
imports the module holding its initializer, so it starts without torch (0.05 s instead of
0.8-1.0 s). It still imports torch when it unpickles the first write results (megatron-core's
``WriteResult`` objects): that cost, about 2 s of CPU per rank and save, remains.
"""
from __future__ import annotations

import multiprocessing
from multiprocessing.managers import SyncManager


def _die_with_parent() -> None:
    """In the results-queue server: be killed when the rank that started it dies (Linux prctl)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def results_queue_dying_with_rank():
    """A ``multiprocessing`` queue served by a spawned manager process that the kernel kills when
    the calling process dies (Linux), so a rank killed mid-save leaves no server behind."""
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    return manager.Queue()
