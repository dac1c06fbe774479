"""The server behind megatron-core's write-results queue: forked from the rank, dying with it.

megatron-core 0.16.1's ``FileSystemWriterAsync`` collects each writer's results through a
``multiprocessing`` manager queue (``filesystem_async._results_queue``) and starts that
manager with ``spawn`` on first use. A spawned server is a fresh interpreter that imports
torch to unpickle the first results (about 2 s of CPU, and the memory of a torch import,
per rank and save) and outlives a rank that is killed. The server here is forked from the
rank instead: torch is already imported, so it serves at once. It only unpickles and holds
write results (no torch operation, no CUDA call), as safe as megatron-core's own forked
writers. The kernel kills it when the rank dies (Linux ``PR_SET_PDEATHSIG``).
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
    """A ``multiprocessing`` queue served by a manager process forked from the caller, which the
    kernel kills when the caller dies (Linux), so a rank killed mid-save leaves no server behind."""
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_die_with_parent)
    return manager.Queue()
