"""launch_local: values come back per rank; the store is shared; a failing rank or a hang is
reported and nothing is left running; signals reach the ranks' stop flags; one rank may run
in-process without a process group."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.dist import RankContext, launch_local


def _sum_ranks(ctx: RankContext, scale: int) -> torch.Tensor:
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t * scale


def _store_and_threads(ctx: RankContext) -> tuple[str, int]:
    ctx.store.set(f"from-{ctx.rank}", str(ctx.rank * 7))
    dist.barrier()
    other = (ctx.rank + 1) % ctx.world
    return ctx.store.get(f"from-{other}").decode(), torch.get_num_threads()


def _rank1_fails(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher's clean-up


def _cuda_view(ctx: RankContext) -> tuple[str | None, bool]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def _sleeps(ctx: RankContext) -> None:
    time.sleep(600)


def _waits_for_stop(ctx: RankContext, signal_launcher: bool) -> bool:
    if signal_launcher and ctx.rank == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not ctx.stop.requested:
        assert time.monotonic() < deadline, "the stop flag was never set"
        time.sleep(0.05)
    return True


@pytest.mark.timeout(120)
def _logs_info(ctx: RankContext) -> None:
    logging.getLogger("nemo_tlt.test").info("hello from a rank")
    logging.getLogger("megatron.core.test").info("a library's chatter")


def test_a_ranks_info_lines_reach_stderr_at_the_launchers_level(capfd):
    """A spawned rank starts with logging unconfigured, where INFO records are dropped; other
    libraries' INFO stays out."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        launch_local(_logs_info, 2, timeout_s=120)
    finally:
        root.setLevel(level)
    err = capfd.readouterr().err
    assert "rank 0 nemo_tlt.test: hello from a rank" in err and "rank 1 nemo_tlt.test: hello from a rank" in err
    assert "a library's chatter" not in err
    launch_local(_logs_info, 2, timeout_s=120)  # at WARNING, the launcher's default, nothing
    assert "hello from a rank" not in capfd.readouterr().err


def test_values_per_rank():
    out = launch_local(_sum_ranks, 2, 10, timeout_s=90)
    assert [v.item() for v in out] == [10.0, 10.0]


@pytest.mark.timeout(120)
def test_ranks_share_the_rendezvous_store_and_get_their_threads():
    assert launch_local(_store_and_threads, 2, timeout_s=90, threads=2) == [("7", 2), ("0", 2)]


@pytest.mark.timeout(120)
def test_failure_is_reported_with_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*boom on rank 1"):
        launch_local(_rank1_fails, 2, timeout_s=90)


@pytest.mark.timeout(120)
def test_timeout_kills_everything():
    import multiprocessing

    with pytest.raises(TimeoutError, match="did not finish"):
        launch_local(_sleeps, 1, timeout_s=5)
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.timeout(120)
def test_a_signal_to_the_launcher_sets_every_ranks_stop_flag():
    """SIGTERM to the launcher does not kill it: it is forwarded to both ranks' StopFlag."""
    before = signal.getsignal(signal.SIGTERM)
    assert launch_local(_waits_for_stop, 2, True, timeout_s=90, forward_signals=True) == [True, True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_single_rank_in_process_has_no_process_group_and_restores_threads():
    before = torch.get_num_threads()
    seen = launch_local(lambda ctx: (ctx.rank, ctx.world, dist.is_initialized(), torch.get_num_threads()),
                        1, threads=before + 1, in_process=True)
    assert seen == [(0, 1, False, before + 1)] and torch.get_num_threads() == before


@pytest.mark.timeout(120)
def test_children_start_with_cuda_hidden(monkeypatch):
    """A user's GPU selection (here "0") is replaced by "" in the children only: CUDA
    initialises from the environment the process started with, so this is what makes
    torch.cuda.is_available() false there on a GPU host."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert launch_local(_cuda_view, 2, timeout_s=90) == [("", False), ("", False)]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert launch_local(_cuda_view, 1, timeout_s=90, hide_cuda=False)[0][0] == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch_local(_cuda_view, 1, timeout_s=90)[0][0] == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def _native_threads() -> list[str]:
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_no_rank_is_forked_while_the_store_serves():
    """fork copies only the calling thread: a rank forked while the store's server thread
    (pt_tcpstore_uv) held a lock would inherit it held for ever. The launcher hosts its
    store only after every rank has started."""
    at_fork: list[list[str]] = []
    recording = [True]
    os.register_at_fork(before=lambda: at_fork.append(_native_threads()) if recording[0] else None)
    try:
        out = launch_local(_sum_ranks, 2, 10, timeout_s=90, start_method="fork")
    finally:
        recording[0] = False  # an at-fork hook cannot be removed: it stops recording
    assert [v.item() for v in out] == [10.0, 10.0]
    assert len(at_fork) == 2 and not [n for names in at_fork for n in names if n.startswith("pt_tcpstore")], at_fork
