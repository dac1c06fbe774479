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
    pids.put(queue.server_pid)
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


def test_results_queue_server_holds_bytes_and_never_imports_torch():
    """Write results cross the server pickled: what a writer puts (torch objects, as megatron-core's
    ``WriteResult`` holds) comes back equal, and the server never loaded torch to unpickle it."""
    import torch

    from nemo_tlt.megatron.results_server import results_queue_dying_with_rank

    queue = results_queue_dying_with_rank()
    try:
        sent = {"rank": 1, "size": torch.Size([2, 3]), "values": torch.arange(6).reshape(2, 3)}
        queue.put(sent)
        assert queue.qsize() == 1
        got = queue.get(timeout=30)
        assert got["rank"] == 1 and got["size"] == sent["size"] and torch.equal(got["values"], sent["values"])
        assert queue.empty()
        with open(f"/proc/{queue.server_pid}/maps") as f:
            loaded = f.read()
        assert "libtorch" not in loaded, "the results-queue server imported torch"
    finally:
        queue.shutdown()
