"""`nemo-tlt bench drafter --quick` runs end to end (tiny sizes, two forked workers)
and writes every headline key beside its raw figures. A smoke run, not a measurement:
the targets themselves are checked by the full benchmark, not here."""
from __future__ import annotations

import json
import math

import pytest

from nemo_tlt.bench import drafter as bench
from nemo_tlt.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)


def test_quick_run_writes_all_keys(tmp_path):
    out = tmp_path / "drafter.json"
    assert cli_main(["bench", "drafter", "--quick", "--preemptions", "2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "drafter"
    assert d["packing_speedup"] > 0 and math.isfinite(d["packing_speedup"])
    p = d["packing"]
    assert p["packed_slot_efficiency"] > p["padded_slot_efficiency"]
    assert d["packing_speedup"] == pytest.approx(p["packed_tokens_per_s"] / p["padded_tokens_per_s"])
    c = d["checkpoint"]
    assert len(c["sync_blocked_ms"]) == len(c["async_blocked_ms"]) == d["config"]["checkpoints"]
    assert d["checkpoint_block_ratio"] == pytest.approx(c["sync_blocked_ms_mean"] / c["async_blocked_ms_mean"])
    lat = d["preemption_latency_ms"]
    assert len(d["preemption"]["samples_ms"]) == 2 and 0 < lat["median"] <= lat["max"] < 60_000
    assert {r["rank"] for r in d["idle"]["per_rank"]} == set(range(d["config"]["workers"]))
    assert_idle_figures_are_consistent(d["idle"], d["idle_utilization"])
    assert set(d["meets_targets"]) == set(bench.TARGETS)


def assert_idle_figures_are_consistent(idle: dict, utilization: float, slack_s: float = 0.05) -> None:
    """The coordinator's state durations against the bench's own clock of each rank's
    rollout share (rollout_s) and of its non-busy call (window_s)."""
    reports = idle["per_rank"]
    for r in reports:
        assert r["idle_s"] >= 0.0 and r["training_s"] >= 0.0
        # IDLE and TRAINING both happen inside the call that ends the rollout share
        assert r["idle_s"] + r["training_s"] <= r["window_s"] + 5e-3, r
        # the simulated share was really slept
        assert r["rollout_s"] >= idle["rollout_seconds"][r["step"]][r["rank"]] - 1e-3, r
        # a rank stays non-busy until the slowest share of its step is done (the ranks
        # start each step together at a barrier; slack_s covers the skew)
        slowest = max(q["rollout_s"] for q in reports if q["step"] == r["step"])
        assert r["idle_s"] + r["training_s"] >= slowest - r["rollout_s"] - slack_s, r
    training = sum(r["training_s"] for r in reports)
    idle_only = sum(r["idle_s"] for r in reports)
    assert training > 0.0  # a rank whose share ended early trained the drafter
    assert idle["training_worker_seconds"] == pytest.approx(training)
    assert idle["idle_not_training_worker_seconds"] == pytest.approx(idle_only)
    assert idle["nonbusy_worker_seconds"] == pytest.approx(training + idle_only)
    assert 0.0 < utilization <= 1.0 and utilization == pytest.approx(training / (training + idle_only))


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="BenchConfig.workers"):
        bench.BenchConfig(workers=1)
    with pytest.raises(ValueError, match="BenchConfig.min_pairs"):
        bench.BenchConfig(min_pairs=500, max_pairs=400)


def test_pareto_lengths_are_clipped_and_long_tailed():
    import numpy as np

    xs = bench.pareto_lengths(np.random.default_rng(0), 2000, 8, 400, 1.0)
    assert min(xs) == 8 and max(xs) == 400
    assert np.median(xs) < 20 < np.mean(xs)  # most short, a heavy tail pulls the mean up
