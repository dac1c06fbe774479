"""Decode segments of one rollout (run-length plain / SD-shape stretches on the
caller's clock) and the worker timeline plot that draws them inside BUSY time."""
from __future__ import annotations

import pytest

from nemo_tlt.rl.reporting.decode_segments import cap_segments, decode_segments
from nemo_tlt.rl.reporting.plots import decode_colors, decode_strips, plot_worker_timeline
from nemo_tlt.rollout.protocol import StepTrace


def trace(*steps):
    return [StepTrace(8, shape, 8, 1.0, seconds) for shape, seconds in steps]


def test_runs_of_one_choice_are_one_segment_within_the_decode_span():
    tr = trace((None, 1.0), (None, 1.0), ("4_1_4", 0.5), ("4_1_4", 0.5), (None, 1.0))
    # 4.0 s of steps, 0.5 s prefill, 5.0 s wall: 0.5 s of bookkeeping spread over 5 steps
    segs = decode_segments(tr, prefill_s=0.5, wall_s=5.0, start=100.0)
    assert [c for _, _, c in segs] == ["plain", "4_1_4", "plain"]
    assert segs[0][0] == pytest.approx(100.5) and segs[-1][1] == pytest.approx(105.0)
    assert [b - a for a, b, _ in segs] == pytest.approx([2.2, 1.2, 1.1])
    assert all(segs[k][1] == segs[k + 1][0] for k in range(len(segs) - 1))
    assert decode_segments([], 0.1, 0.2, 0.0) == []


def test_too_many_segments_merge_the_shortest_into_its_longer_neighbour():
    segs = [[0, 5, "plain"], [5, 5.1, "a"], [5.1, 8, "plain"], [8, 8.5, "b"], [8.5, 9, "a"]]
    capped = cap_segments(segs, 3)
    assert capped == [[0, 8, "plain"], [8, 8.5, "b"], [8.5, 9, "a"]]
    assert cap_segments(segs, 1) == [[0, 9, "plain"]]
    flicker = decode_segments(trace(*[(None if k % 2 else "4_1_4", 0.1) for k in range(200)]), 0.0, 20.0, 0.0,
                              max_segments=10)
    assert len(flicker) <= 10 and flicker[0][0] == 0.0 and flicker[-1][1] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="max_segments"):
        decode_segments(trace((None, 1.0)), 0.0, 1.0, 0.0, max_segments=0)


def _record(step, segments):
    t = 10.0 * step
    return {"step": step, "t_end": t + 9.0, "decode_segments": segments,
            "timeline": [[0, "busy", t], [1, "busy", t], [0, "idle", t + 6.0], [1, "idle", t + 3.0],
                         [1, "training", t + 3.1], [1, "idle", t + 5.9]]}


def test_worker_timeline_draws_decode_strips(tmp_path):
    tlt = [_record(0, [[0, 0.2, 2.0, "plain"], [0, 2.0, 6.0, "4_1_4"], [1, 0.2, 3.0, "6_2_12"]]),
           _record(1, [[0, 10.2, 16.0, "plain"], [1, 10.2, 13.0, "4_1_4"]])]
    base = [_record(0, [[0, 0.2, 6.0, "plain"], [1, 0.2, 3.0, "plain"]])]
    strips = decode_strips(tlt)
    assert strips[0] == [(0.2, 2.0, "plain"), (2.0, 6.0, "4_1_4"), (10.2, 16.0, "plain")]
    assert decode_strips([{k: v for k, v in base[0].items() if k != "decode_segments"}]) == {}
    colors = decode_colors({"tlt": tlt, "baseline": base})
    assert list(colors) == ["plain", "4_1_4", "6_2_12"] and len(set(colors.values())) == 3
    out = plot_worker_timeline({"tlt": tlt, "baseline": base}, tmp_path / "worker_timeline.png")
    assert out.stat().st_size > 0
    # the pipelined update's group gradients get a colour of their own
    tlt[1]["decode_segments"].append([1, 13.0, 14.5, "update"])
    colors = decode_colors({"tlt": tlt, "baseline": base})
    assert list(colors) == ["plain", "update", "4_1_4", "6_2_12"] and len(set(colors.values())) == 4
