"""A new part is one file: a rollout engine, a drafter kind and an RL algorithm defined in a
test module, not registered anywhere, named by their import paths (the config; the drafter's
``drafter.json``), run the demo loop (2 steps, 2 workers; the algorithm in both update paths);
and the registries' own rules."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nemo_tlt.drafter.io import load_drafter, save_drafter
from nemo_tlt.registry import Registry
from nemo_tlt.train import main
from tiny_rl import tiny_overrides


def _algorithm_calls(log: Path) -> list[tuple[str, int, int]]:
    return [(pid, int(dropped), int(tokens)) for pid, dropped, tokens in map(str.split, log.read_text().splitlines())]


def _assert_first_half_counted(run_dir: Path, losses: list[tuple[str, int, int]]) -> None:
    """Each step's token mean is over the first half of each group of 4 (FirstHalfGRPO), and
    the loss calls saw exactly those tokens."""
    records = [json.loads(line) for line in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    for r in steps:
        assert r["loss_tokens"] == sum(n for i, n in enumerate(r["resp_lens"]) if i % 4 < 2)
    assert sum(t for _, _, t in losses) == sum(r["loss_tokens"] for r in steps)


def _toy_drafter(drafter: Path, folder: Path) -> Path:
    """The tiny EAGLE drafter's weights as a ``toy_parts:COUNTING_EAGLE`` drafter."""
    from toy_parts import CountingEagle

    eagle = load_drafter(drafter)
    toy = CountingEagle(eagle.config)
    toy.load_state_dict(eagle.state_dict())
    save_drafter(toy, folder)
    assert json.loads((folder / "drafter.json").read_text())["kind"] == "toy_parts:COUNTING_EAGLE"
    return folder


def test_an_engine_a_drafter_kind_and_an_algorithm_named_by_import_path_run_the_loop(tiny_models, tmp_path,
                                                                                      monkeypatch):
    target, drafter = tiny_models
    drafter = _toy_drafter(drafter, tmp_path / "toy_drafter")
    log, algo_log, drafter_log = tmp_path / "engine.log", tmp_path / "algorithm.log", tmp_path / "drafter.log"
    monkeypatch.setenv("TOY_ENGINE_LOG", str(log))
    monkeypatch.setenv("TOY_ALGORITHM_LOG", str(algo_log))
    monkeypatch.setenv("TOY_DRAFTER_LOG", str(drafter_log))
    run_dir = tmp_path / "run"
    yaml = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    # and the weight-sync digests off (the default outside the demo): nothing hashed, nothing compared
    overrides = [*tiny_overrides(target, drafter, run_dir, steps=2), "rollout.engine=toy_parts:counting_engine",
                 "algorithm=toy_parts:FirstHalfGRPO", "debug.weight_digests=0"]
    assert main([str(yaml), *overrides]) == 0
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _ in calls}) == 2 and len(calls) == 4  # each worker, each step
    # the pipelined update (demo.yaml's): every loss call saw the dropped half with no token,
    # and the step's token mean is over the counted half alone
    losses = _algorithm_calls(algo_log)
    assert {pid for pid, _, _ in losses} <= {pid for pid, _ in calls} and any(d > 0 for _, d, _ in losses)
    _assert_first_half_counted(run_dir, losses)
    # the drafter kind drafted in the rollouts and trained in the idle time
    drafted = [line.split() for line in drafter_log.read_text().splitlines()]
    assert {what for _, what in drafted} == {"propose", "loss"}
    records = [json.loads(line) for line in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["replicas_identical"] is None and r["policy_digest"] is None and r["weight_digest_s"] == 0.0
               for r in steps)


def test_an_algorithm_and_a_launcher_named_by_import_path_in_the_synchronous_update(tiny_models, tmp_path,
                                                                                    monkeypatch):
    target, drafter = tiny_models
    algo_log, launcher_log = tmp_path / "algorithm.log", tmp_path / "launcher.log"
    monkeypatch.setenv("TOY_ALGORITHM_LOG", str(algo_log))
    monkeypatch.setenv("TOY_LAUNCHER_LOG", str(launcher_log))
    run_dir = tmp_path / "run"
    yaml = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    overrides = [*tiny_overrides(target, drafter, run_dir, steps=2), "policy.pipelined_update=false",
                 "algorithm=toy_parts:FirstHalfGRPO", "debug.weight_digests=0",
                 "workers.launcher=toy_parts:TOY_LAUNCHER"]
    assert main([str(yaml), *overrides]) == 0
    assert launcher_log.read_text().split() == [str(os.getpid()), "2"]  # one launch of 2 ranks, from here
    assert "launcher: toy_parts:TOY_LAUNCHER" in (run_dir / "config.yaml").read_text()
    losses = _algorithm_calls(algo_log)
    assert len({pid for pid, _, _ in losses}) == 2 and any(d > 0 for _, d, _ in losses)
    _assert_first_half_counted(run_dir, losses)


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
