"""A new part is one file: a rollout engine defined in a test module, not registered anywhere,
named by its import path in the config, runs the demo loop (2 steps, 2 workers); and the
registries' own rules."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_tlt.registry import Registry
from nemo_tlt.train import main
from tiny_rl import tiny_overrides


def test_an_engine_named_by_import_path_runs_the_loop(tiny_models, tmp_path, monkeypatch):
    target, drafter = tiny_models
    log = tmp_path / "engine.log"
    monkeypatch.setenv("TOY_ENGINE_LOG", str(log))
    run_dir = tmp_path / "run"
    yaml = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    # and the weight-sync digests off (the default outside the demo): nothing hashed, nothing compared
    overrides = [*tiny_overrides(target, drafter, run_dir, steps=2), "rollout.engine=toy_parts:counting_engine",
                 "debug.weight_digests=0"]
    assert main([str(yaml), *overrides]) == 0
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _ in calls}) == 2 and len(calls) == 4  # each worker, each step
    records = [json.loads(line) for line in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["replicas_identical"] is None and r["policy_digest"] is None and r["weight_digest_s"] == 0.0
               for r in steps)


def test_a_wrong_import_path_stops_before_any_worker_starts(tmp_path, capsys):
    yaml = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    assert main([str(yaml), f"run_dir={tmp_path}", "rollout.engine=toy_parts:no_such_factory"]) == 2
    assert "rollout.engine='toy_parts:no_such_factory': 'toy_parts' has no attribute" in capsys.readouterr().err


def test_registry_names_built_ins_registered_ones_and_import_paths():
    reg = Registry("toy", "toy.kind", {"json": "json:dumps"})
    assert reg.get("json")({"a": 1}) == '{"a": 1}' and reg.get("json:loads")("[1]") == [1]
    reg.register("upper")(str.upper)
    assert reg.names() == ("json", "upper") and reg.get("upper")("x") == "X" and "upper" in reg
    with pytest.raises(ValueError, match=r"toy.kind must be one of \['json', 'upper'\] or an import path"):
        reg.check("yaml")
    with pytest.raises(ValueError, match="registered already"):
        reg.register("json", len)
    with pytest.raises(ValueError, match="without ':'"):
        reg.register("a:b", len)
    with pytest.raises(ValueError, match="cannot import module"):
        reg.get("no_such_module_here:f")
