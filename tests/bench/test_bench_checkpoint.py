"""`nemo-tlt bench checkpoint`'s measure of a rank's descendants (the 0.5B run and its figures:
docs/benchmarks.md). megatron-core writes a checkpoint from forked processes, whose memory the
rank's own VmHWM does not see: ``ChildrenPeak`` must count what a child adds, and not the pages
it shares with its parent."""
from __future__ import annotations

import multiprocessing
import time

import pytest

from nemo_tlt.bench.checkpoint import ChildrenPeak, layer_state_bytes

MB = 2**20


def _allocate_and_hold(mb: int, started, release) -> None:
    block = bytearray(mb * MB)  # zero pages are only resident once written
    for i in range(0, len(block), 4096):
        block[i] = 1
    started.set()
    release.wait(30)


def _count_child(mb: int) -> int:
    ctx = multiprocessing.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    with ChildrenPeak(interval_s=0.005) as peak:
        child = ctx.Process(target=_allocate_and_hold, args=(mb, started, release))
        child.start()
        started.wait(30)
        time.sleep(0.1)  # a few samples while the child holds its block
        release.set()
        child.join()
    return peak.peak


def test_children_peak_counts_what_a_forked_child_adds_not_what_it_shares():
    pytest.importorskip("psutil")
    shared = bytearray(200 * MB)  # resident in the parent, shared with the forked child
    for i in range(0, len(shared), 4096):
        shared[i] = 1
    got = _count_child(64)
    assert 64 * MB <= got < 64 * MB + 60 * MB, got  # the child's block and its own touched pages, not 200 MB
    del shared


def test_layer_state_bytes_counts_weights_and_three_fp32_values():
    import torch

    from nemo_tlt.model.config import LMConfig

    cfg = LMConfig(hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1)
    params = 2 * 8 + 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # 2 norms, q+o, k+v, gate/up/down
    assert layer_state_bytes(cfg, torch.bfloat16) == params * (2 + 12)
    assert layer_state_bytes(cfg, torch.float32) == params * (4 + 12)


def test_bench_checkpoint_runs_every_method_on_every_rank(tmp_path):
    """The command on a tiny model (where the fixed cost of megatron's writer processes dwarfs
    the shard, so the target is not asserted): every method, every rank reported."""
    pytest.importorskip("megatron.core")
    import json

    from nemo_tlt.bench.checkpoint import main

    out = tmp_path / "checkpoint.json"
    rc = main(["--out", str(out), "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
               "--ffn", "128", "--vocab", "300", "--trials", "1", "--timeout-s", "300"])
    report = json.loads(out.read_text())
    assert rc in (0, 1) and report["order"] == ["sharded", "async", "control"]
    assert sorted(tuple(r["coords"]) for r in report["per_rank"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in report["per_rank"]:
        live = rank["live_bytes"]
        # the rank wrote its weights, main params and moments (plus the file format's metadata)
        assert rank["own_shard_bytes"] >= live["weights"] + live["main"] + live["moments"]
        assert rank["budget_bytes"] == rank["own_shard_bytes"] + report["layer_state_bytes"]
        assert rank["peak_extra_bytes"]["sharded"] > 0 and rank["peak_extra_bytes"]["async"] > 0
