"""`nemo-tlt plan --measured`: response lengths, accepted lengths per arm and the calibrated
drafter overhead from a run folder or a bench JSON replace the assumed inputs, and the
plan JSON says which inputs were measured, from where, and which stayed assumed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nemo_tlt.plan.build import make_plan, plan_inputs
from nemo_tlt.plan.config import load_plan_config
from nemo_tlt.plan.measured import read_measured

from test_calibrate import write_run

CONF = Path(__file__).resolve().parents[2] / "conf"
SAMPLES = [10, 12, 15, 20, 20, 25, 30, 40, 80, 200]   # median 22.5, a long tail


def bench_json(tmp_path: Path) -> Path:
    path = tmp_path / "bench_longtail.json"
    path.write_text(json.dumps({
        "benchmark": "rollout", "workload": "longtail",
        "results": {"longtail_plain": {"mean_accept_len": 1.0}, "longtail_fixed_4_1_4": {"mean_accept_len": 2.5},
                    "longtail_fixed_6_1_6": {"mean_accept_len": 3.1}},
        "response_lengths": {"median": 25, "max": 200, "min": 10, "samples": SAMPLES}}))
    return path


def run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "mode": "tlt", "resp_lens": SAMPLES, "accept_by_arm": {"6_2_12": [30, 10], "8_4_32": [8, 2]}}
            for s in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    return load_plan_config(CONF / "qwen2.5-32b_plan.yaml", ["steps=1"])


def test_bench_json_replaces_lengths_and_the_arms_it_measured(plan, tmp_path):
    out, _ = make_plan(plan, measured=[str(bench_json(tmp_path))])
    inputs = out["inputs"]
    assert inputs["lengths"]["source"] == "measured" and inputs["lengths"]["from"].endswith("bench_longtail.json")
    used, measured = inputs["lengths"]["used"], inputs["lengths"]["measured"]
    assert used["median"] == pytest.approx(plan.lengths.median)          # median from the plan
    assert measured["median"] == float(np.median(SAMPLES)) and used["max_over_median"] == 16384 / used["median"]
    scaled = plan_inputs(plan, [str(tmp_path / "bench_longtail.json")]).lengths.samples
    ratio = plan.lengths.median / float(np.median(SAMPLES))   # the shape is kept, up to max_response_len
    assert list(scaled) == [min(16384, round(n * ratio)) for n in SAMPLES]
    arms = inputs["sd.accepted"]
    assert arms["4_1_4"] == {"source": "measured", "from": str(tmp_path / "bench_longtail.json"), "value": 2.5}
    assert arms["6_2_12"]["source"] == "assumed" and arms["6_2_12"]["value"] == 3.6
    assert inputs["sd.accepted_not_used"]["arms"] == ["6_1_6"]
    assert inputs["cluster.draft_overhead_ms"]["source"] == "assumed"


def test_the_simulation_uses_the_measured_inputs(plan, tmp_path):
    assumed, _ = make_plan(plan, simulate_steps=True)
    measured, _ = make_plan(plan, simulate_steps=True, measured=[str(run_folder(tmp_path))])
    assert assumed["inputs"]["lengths"]["source"] == "assumed"
    assert measured["inputs"]["sd.accepted"]["6_2_12"] == {"source": "measured", "from": str(tmp_path / "run"),
                                                           "value": 3.0}
    assert measured["inputs"]["sd.accepted"]["8_4_32"]["value"] == 4.0
    assert measured["simulation"]["speedup"] != assumed["simulation"]["speedup"]
    inputs = plan_inputs(plan, [str(tmp_path / "run")])
    assert inputs.accepted == (3.0, 3.0, 4.0) and len(inputs.lengths.samples) == 2 * len(SAMPLES)
    assert float(np.median(inputs.lengths.samples)) == pytest.approx(plan.lengths.median, rel=1e-3)


def test_plan_yaml_keys_name_the_sources(monkeypatch, tmp_path):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / "qwen2.5-32b_plan.yaml",
                            [f"measured.bench_json={bench_json(tmp_path)}", "measured.length_scaling=none"])
    out, _ = make_plan(plan)
    assert out["inputs"]["sd.accepted"]["4_1_4"]["source"] == "measured"
    assert out["inputs"]["lengths"]["used"]["median"] == float(np.median(SAMPLES))


def test_a_run_without_per_sequence_lengths_says_so(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "mode": "tlt", "resp_len_max": 9}) + "\n")
    m = read_measured(run)
    assert m.lengths == () and m.accepted == {}
    assert any("resp_lens" in n for n in m.notes) and any("accept_by_arm" in n for n in m.notes)


def test_calibrated_drafter_overhead_is_fed_back(plan, tmp_path):
    run = write_run(tmp_path / "cmp")          # fixed costs a = 10 ms (plain), c = 20 ms (SD), deepest arm 6_2_12
    m = read_measured(run)
    assert m.draft_overhead_ratio == pytest.approx((0.020 / 0.010 - 1) / 6, rel=0.02)
    inputs = plan_inputs(plan, [str(run)])
    assert inputs.provenance["cluster.draft_overhead_ms"]["source"] == "calibrated"
    assert inputs.draft_overhead_ms == pytest.approx(m.draft_overhead_ratio * plan.cluster.forward_overhead_ms)
