"""`nemo-tlt bench checkpoint`'s measure of a rank's descendants and its figures (the 0.5B run:
docs/benchmarks.md). megatron-core writes a checkpoint from forked processes, whose memory the
rank's own VmHWM does not see: ``ChildrenPeak`` must count what a child adds, and not the pages
it shares with its parent, and the pages the parent rewrites while its descendants still map
them (the old copies stay with the descendants, shared by all of them). The write in flight
during an update is reported net of the update alone."""
from __future__ import annotations

import multiprocessing
import time

import pytest

from nemo_tlt.bench.checkpoint import IN_FLIGHT, METHODS, layer_state_bytes, rank_summary
from nemo_tlt.bench.tree_memory import ChildrenPeak

MB = 2**20


def _settle(peak: ChildrenPeak, samples: int = 2, timeout_s: float = 30.0) -> None:
    """Wait until ``peak`` has taken ``samples`` whole samples from now (a loaded machine may
    deschedule its thread for longer than any fixed sleep)."""
    until, deadline = peak.samples + samples + 1, time.monotonic() + timeout_s
    while peak.samples < until and time.monotonic() < deadline:
        time.sleep(0.005)


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
        _settle(peak)  # whole samples while the child holds its block
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


def _hold_with_a_grandchild(started, release) -> None:
    ctx = multiprocessing.get_context("fork")
    grandchild = ctx.Process(target=release.wait, args=(30,))
    grandchild.start()
    started.set()
    release.wait(30)
    grandchild.join()


def test_children_peak_counts_the_pages_a_parent_rewrites_while_two_descendants_map_them():
    """The update during an async save: the parent rewrites its block while a child and the
    child's own child (megatron's writer and its writers) still map it; the old pages stay with
    them, shared by both, so neither holds them privately: 64 MB must still be counted, once."""
    pytest.importorskip("psutil")
    block = bytearray(64 * MB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    ctx = multiprocessing.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    with ChildrenPeak(interval_s=0.005) as peak:
        child = ctx.Process(target=_hold_with_a_grandchild, args=(started, release))
        child.start()
        started.wait(30)
        for i in range(0, len(block), 4096):  # copy on write: the parent maps fresh copies
            block[i] = 2
        _settle(peak)
        release.set()
        child.join()
    assert 64 * MB <= peak.peak < 64 * MB + 60 * MB, (peak.peak, peak.private_peak)


def _measure_of_a_forked_process(out) -> None:
    with ChildrenPeak(interval_s=0.005) as peak:
        pass
    out.put((peak.outside_shared_bytes, peak.measure))


def test_children_peak_falls_back_to_private_bytes_in_a_process_sharing_its_parents_pages():
    """The Pss figure presumes no page of the measured process is mapped outside its tree: a
    process forked from a live parent shares the parent's pages, so it reports its descendants'
    private bytes instead."""
    pytest.importorskip("psutil")
    shared = bytearray(64 * MB)  # resident in this process, shared with the forked one
    for i in range(0, len(shared), 4096):
        shared[i] = 1
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_measure_of_a_forked_process, args=(out,))
    child.start()
    outside, measure = out.get(timeout=60)
    child.join()
    assert outside >= 32 * MB and measure == "private"  # every shared page counts half in its Pss
    del shared


def _row(peak: int, shard: int = 1000) -> dict:
    return {"coords": [0, 0], "written_bytes": shard, "live": {}, "view_bytes": 0, "peak_extra_bytes": peak,
            "rank_extra_bytes": peak, "children_bytes": 0, "children_pss_bytes": 0, "children_private_bytes": 0,
            "children_measure": "pss_anon", "wall_s": 1.0,
            "update_end_s": 1.0, "writers_end_s": 2.0, "most_children": 4, "policy_step": 1, "samples": 10,
            "dropped": 0}


def test_the_write_in_flight_is_the_peak_during_an_update_minus_the_update_alone():
    """Budget 1000 + 200: the update alone peaks at 900, with the write in flight at 1900 / 2000
    (median 1950): the write in flight is 1050, within budget though the raw peak is not. The
    step's pair is reported the same way, and either over budget misses the target; the
    unguarded rewrite's pair (touch) is reported only."""
    rows = {m: [_row(100), _row(100)] for m in METHODS}
    rows["update_alone"] = [_row(900), _row(800), _row(1000)]
    rows["async_update"] = [_row(1900), _row(2000)]
    rows["step_alone"], rows["async_step"] = [_row(300)], [_row(1300)]
    got = rank_summary(rows, layer=200)
    assert got["budget_bytes"] == 1200 and got["peak_extra_bytes"]["async_update"] == 1950
    assert got["write_in_flight_extra_bytes"] == {"update": 1950 - 900, "step": 1000, "touch": 0}
    assert got["in_flight_within_target"] and got["save_within_target"]
    assert got["in_flight_over_budget"] == {"update": round(1050 / 1200, 3), "step": round(1000 / 1200, 3),
                                            "touch": 0.0}
    rows["update_alone"] = [_row(500)]
    assert rank_summary(rows, layer=200)["write_in_flight_extra_bytes"]["update"] == 1450
    assert not rank_summary(rows, layer=200)["in_flight_within_target"]
    rows["update_alone"], rows["step_alone"] = [_row(900)], [_row(50)]
    assert not rank_summary(rows, layer=200)["in_flight_within_target"]  # the step's 1250
    # the unguarded rewrite is reported, not judged: a run never rewrites the state during a write
    rows["step_alone"], rows["async_touch"] = [_row(300)], [_row(1400)]
    got = rank_summary(rows, layer=200)
    assert got["in_flight_within_target"] and got["write_in_flight_extra_bytes"]["touch"] == 1300


def test_layer_state_bytes_counts_weights_and_three_fp32_values():
    import torch

    from nemo_tlt.model.config import LMConfig

    cfg = LMConfig(hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1)
    params = 2 * 8 + 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # 2 norms, q+o, k+v, gate/up/down
    assert layer_state_bytes(cfg, torch.bfloat16) == params * (2 + 12)
    assert layer_state_bytes(cfg, torch.float32) == params * (4 + 12)


# The kinds of method the command runs: a blocking save, an async one, and a save in flight
# during work against the same work alone (the step pair; the update and touch pairs differ
# only in the work, and rank_summary's arithmetic over all nine is tested above). Each method
# starts four ranks and a results server per save; the ranks are forked (--start-method fork),
# so they do not import megatron-core again.
SMOKE_METHODS = ("sharded", "async", "async_step", "step_alone")


@pytest.mark.timeout(180)
def test_bench_checkpoint_runs_every_kind_of_method_on_every_rank(tmp_path, monkeypatch):
    """The command on a tiny model (where the fixed cost of megatron's writer processes dwarfs
    the shard, so the target is not asserted), limited to ``SMOKE_METHODS``: each method
    reported for every rank, the parts of each peak adding up, writers alive only with a save."""
    pytest.importorskip("megatron.core")
    import json

    import nemo_tlt.bench.checkpoint as bench

    in_flight = {"step": IN_FLIGHT["step"]}
    monkeypatch.setattr(bench, "METHODS", SMOKE_METHODS)
    monkeypatch.setattr(bench, "IN_FLIGHT", in_flight)
    monkeypatch.setattr(bench, "TARGET_WORK", ("step",))

    out = tmp_path / "checkpoint.json"
    rc = bench.main(["--out", str(out), "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
                     "--ffn", "128", "--vocab", "300", "--trials", "1", "--timeout-s", "150",
                     "--start-method", "fork"])
    report = json.loads(out.read_text())
    # the exit status is the report's verdict (the tiny model's targets may go either way)
    assert rc == (0 if report["within_target"] else 1) and report["order"] == list(SMOKE_METHODS)
    assert sorted(tuple(r["coords"]) for r in report["per_rank"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in report["per_rank"]:
        live = rank["live_bytes"]
        # the rank wrote its weights, main params and moments (plus the file format's metadata)
        assert rank["own_shard_bytes"] >= live["weights"] + live["main"] + live["moments"]
        assert rank["budget_bytes"] == rank["own_shard_bytes"] + report["layer_state_bytes"]
        peak, parts = rank["peak_extra_bytes"], rank["peak_parts"]
        assert peak["sharded"] > 0 and peak["async"] > 0
        for m in SMOKE_METHODS:  # one trial: the peak is the rank's part plus its descendants'
            assert peak[m] == parts[m]["rank_extra_bytes"] + parts[m]["children_bytes"]
        # ranks forked from this test process share its pages: the descendants' figure is their
        # private bytes (the Pss figure needs a spawned rank, tree_memory)
        assert rank["children_measure"] == ["private"]
        # the writers and the results server during the update or step; no descendant without a save
        for work, (during, alone) in in_flight.items():
            # (the server and the forked writer live through the whole write, its 2 writers only
            # while they write)
            assert parts[during]["children_bytes"] > 0 and parts[alone]["children_bytes"] == 0
            assert rank["most_children"][during] >= 2 and rank["most_children"][alone] == 0
            assert rank["update_end_s"][during][0] > 0 and rank["update_end_s"][alone][0] > 0
            assert rank["samples"][during] > 0
            assert rank["write_in_flight_extra_bytes"][work] == peak[during] - peak[alone]
        assert all(len(ends) == 1 for ends in rank["writers_end_s"].values())
        # one update before every method, a second optimizer step in the update and step pairs
        assert rank["policy_step"] == {m: 2 if m in in_flight["step"] else 1 for m in SMOKE_METHODS}
