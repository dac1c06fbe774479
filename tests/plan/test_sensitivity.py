"""`nemo-tlt plan CONFIG --sensitivity`: every assumption at both ends of its range."""
from __future__ import annotations

from pathlib import Path

from nemo_tlt.plan.cli import main
from nemo_tlt.plan.sensitivity import RANGES

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_every_assumption_at_both_ends(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(CONF.parent)
    out = tmp_path / "s.json"
    assert main([str(CONF / "qwen2.5-32b_plan.yaml"), "steps=1", "--sensitivity", "--markdown", "--out", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    rows = {r["assumption"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(RANGES) and len(rows) == len(result["rows"])
    expected = {"sd.accepted", "sd.drift", "sd.recover_gpu_s", "cluster.flops_efficiency",
                "cluster.hbm_efficiency", "lengths.median", "lengths.sigma"}
    assert expected <= set(rows)
    for name, r in rows.items():
        assert (r["low"], r["high"]) == RANGES[name][:2] and r["low"] < r["high"]
        for end in ("at_low", "at_high"):
            assert r[end]["speedup"] > 0 and r[end]["speedup_pipelined"] >= r[end]["speedup"] - 1e-9
    # the accepted lengths move the prediction the way they must
    assert rows["sd.accepted"]["at_low"]["speedup"] < result["planned"]["speedup"] < rows["sd.accepted"]["at_high"]["speedup"]
    assert rows["lengths.median"]["at_low"]["speedup"] != rows["lengths.median"]["at_high"]["speedup"]
    assert "| `lengths.sigma`" in capsys.readouterr().out


def test_measured_lengths_are_varied_from_the_measured_shape_not_the_clipped_one(monkeypatch, tmp_path):
    """With measured lengths the `lengths.median` and `lengths.sigma` rows rescale the samples
    as measured: a tail past `batch.max_response_len` at the planned median is clipped there,
    but at half the median it fits and must keep its ratio to the median. At the planned
    values both rows give the planned samples back, and the table shows the planned
    samples' median and the measured shape's log-sigma (not the assumed, unused sigma)."""
    import json

    from nemo_tlt.plan.build import plan_inputs
    from nemo_tlt.plan.config import load_plan_config
    from nemo_tlt.plan.measured import length_summary, scale_lengths
    from nemo_tlt.plan.sensitivity import _planned_value

    monkeypatch.chdir(CONF.parent)
    raw = [10, 12, 15, 20, 20, 25, 30, 40, 80, 300]   # median 22.5: 300 is 13.3x it, 26.7k tokens at median 2000
    bench = tmp_path / "bench_longtail.json"
    bench.write_text(json.dumps({"benchmark": "rollout", "workload": "longtail", "results": {},
                                 "response_lengths": {"samples": raw}}))
    plan = load_plan_config(CONF / "qwen2.5-32b_plan.yaml", ["steps=1"])
    inputs = plan_inputs(plan, [str(bench)])
    assert inputs.measured_lengths == tuple(raw) and max(inputs.lengths.samples) == 16384   # clipped
    median, sigma = RANGES["lengths.median"][2], RANGES["lengths.sigma"][2]
    _, low = median(plan, inputs, 1000.0)
    assert low.lengths.samples == scale_lengths(raw, 1000.0, 16384)        # 300 -> 13333, not 16384 / 2
    assert max(low.lengths.samples) == round(300 * 1000 / 22.5)
    assert median(plan, inputs, _planned_value("lengths.median", plan, inputs))[1].lengths.samples \
        == inputs.lengths.samples
    planned_sigma = _planned_value("lengths.sigma", plan, inputs)
    assert planned_sigma == length_summary(raw)["log_sigma"] != plan.lengths.sigma
    assert sigma(plan, inputs, planned_sigma)[1].lengths.samples == inputs.lengths.samples
    wide = sigma(plan, inputs, 2 * planned_sigma)[1].lengths.samples          # every ratio squared
    assert wide == scale_lengths(raw, plan.lengths.median, 16384, 2.0) and max(wide) == 16384
