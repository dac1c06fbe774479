"""The results-queue server of an asynchronous sharded save dies with the rank that started it
(``nemo_tlt.megatron.results_server``): a rank killed between the start of the
save and its finalize must not leave the server behind, orphaned and holding its stdout."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _start_server_then_hang(pids) -> None:
    from nemo_tlt.megatron.results_server import results_queue_dying_with_rank

    queue = results_queue_dying_with_rank()
    pids.put(queue._manager._process.pid)
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_results_queue_server_dies_with_a_killed_rank():
    ctx = multiprocessing.get_context("fork")
    pids = ctx.Queue()
    rank = ctx.Process(target=_start_server_then_hang, args=(pids,))
    rank.start()
    server = pids.get(timeout=60)
    assert _alive(server)
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the results-queue server outlived its killed rank"
