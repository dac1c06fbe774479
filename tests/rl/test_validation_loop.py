"""`validation.every`: the loop evaluates held-out prompts after every `every`-th step,
metrics.jsonl gets `"split": "validation"` records, the plots a validation curve; a
validation split that cannot be read stops `nemo-tlt train` before any work (exit 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_tlt.train import main

from tiny_rl import tiny_overrides

pytestmark = pytest.mark.timeout(180)
DEMO = str(Path(__file__).resolve().parents[2] / "conf" / "demo.yaml")


def test_validation_records_and_curve(tiny_models, tmp_path):
    target, drafter = tiny_models
    run = tmp_path / "run"
    assert main([DEMO, *tiny_overrides(target, drafter, run, steps=4, workers=1),
                 "validation.every=2", "validation.num_prompts=4", "validation.max_new_tokens=40"]) == 0
    lines = [json.loads(x) for x in (run / "tlt" / "metrics.jsonl").read_text().splitlines()]
    checks = [r for r in lines if r.get("split") == "validation"]
    assert [r["step"] for r in checks] == [1, 3]
    assert all(r["num_prompts"] == 4 and 0.0 <= r["mean_reward"] and "accuracy" in r for r in checks)
    assert len([r for r in lines if r.get("split") != "validation"]) == 4  # the training records as before
    assert (run / "validation_vs_step.png").is_file()


def test_an_unreadable_validation_split_stops_before_any_work(tiny_models, tmp_path, capsys):
    target, drafter = tiny_models
    run = tmp_path / "run"
    code = main([DEMO, *tiny_overrides(target, drafter, run, steps=1, workers=1), "validation.every=1",
                 "validation.num_prompts=null"])
    assert code == 2
    assert "validation.num_prompts" in capsys.readouterr().err
    assert not (run / "tlt" / "metrics.jsonl").exists()
