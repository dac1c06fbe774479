"""run_gloo: values come back per rank; a failing rank or a hang is reported and nothing is left running."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_patches.gloo_launch import run_gloo


def _sum_ranks(rank: int, world: int, scale: int) -> torch.Tensor:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t * scale


def _rank1_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher's clean-up


def _cuda_view(rank: int, world: int) -> tuple[str | None, bool]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def _sleeps(rank: int, world: int) -> None:
    time.sleep(600)


@pytest.mark.timeout(120)
def test_values_per_rank():
    out = run_gloo(_sum_ranks, 2, 10, timeout_s=90)
    assert [v.item() for v in out] == [10.0, 10.0]


@pytest.mark.timeout(120)
def test_failure_is_reported_with_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*boom on rank 1"):
        run_gloo(_rank1_fails, 2, timeout_s=90)


@pytest.mark.timeout(120)
def test_timeout_kills_everything():
    import multiprocessing

    with pytest.raises(TimeoutError, match="did not finish"):
        run_gloo(_sleeps, 1, timeout_s=5)
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.timeout(120)
def test_children_start_with_cuda_hidden(monkeypatch):
    """A user's GPU selection (here "0") is replaced by "" in the children only: CUDA
    initialises from the environment the process started with, so this is what makes
    torch.cuda.is_available() false there on a GPU host."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_gloo(_cuda_view, 2, timeout_s=90) == [("", False), ("", False)]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert run_gloo(_cuda_view, 1, timeout_s=90, hide_cuda=False)[0][0] == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert run_gloo(_cuda_view, 1, timeout_s=90)[0][0] == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
