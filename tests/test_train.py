"""`nemo-tlt train --compare-baseline --pairs N`: the flags, the alternating run order,
one folder (and checkpoint folder) per run, resume skipping finished runs, and the
report over pairs. `launch` is replaced by a fake that returns step records, so no
model runs here (the real loop: test_loop_e2e.py, test_resume.py)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.rollout.trtllm_config import TRTLLM_INSTALL, TRTLLM_REQUIREMENT
from nemo_tlt import train as train_cli
from nemo_tlt.train import TrainArgs, build_plan, main, pair_orders, parse_argv

DEMO = Path(__file__).resolve().parents[1] / "conf" / "demo.yaml"


def test_pairs_flag_parsing():
    assert parse_argv([str(DEMO), "--compare-baseline"]) == TrainArgs(str(DEMO), [], True, 2)
    assert parse_argv([str(DEMO), "steps=2", "--compare-baseline", "--pairs", "3"]).pairs == 3
    assert parse_argv([str(DEMO), "--pairs=1", "--compare-baseline"]).pairs == 1


@pytest.mark.parametrize("argv, message", [
    (["--compare-baseline", "--pairs", "0"], r"--pairs must be an integer >= 1, got 0"),
    (["--compare-baseline", "--pairs", "-2"], r"--pairs must be an integer >= 1, got -2"),
    (["--compare-baseline", "--pairs=two"], r"--pairs must be an integer >= 1, got 'two'"),
    (["--compare-baseline", "--pairs"], r"--pairs needs a value"),
    (["--pairs", "3"], r"--pairs needs --compare-baseline"),
])
def test_bad_pairs_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        parse_argv([str(DEMO), *argv])
    assert main([str(DEMO), *argv]) == 2
    assert "--pairs" in capsys.readouterr().err


def test_order_alternates_between_pairs():
    assert pair_orders(3) == [("tlt", "baseline"), ("baseline", "tlt"), ("tlt", "baseline")]


def test_every_run_has_its_own_folder_and_checkpoints(tmp_path):
    for ckpt in ("checkpoints", str(tmp_path / "abs_ckpt")):
        cfg = load_config(DEMO, [f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}"])
        plan = build_plan(cfg, TrainArgs(str(DEMO), [], True, 2), "t", "d")
        assert [(r.pair, r.spec.mode) for r in plan] == [(1, "tlt"), (1, "baseline"), (2, "baseline"), (2, "tlt")]
        assert [r.spec.out_dir for r in plan] == [str(tmp_path / "run" / f"pair{k}" / m) for k, m in
                                                   ((1, "tlt"), (1, "baseline"), (2, "baseline"), (2, "tlt"))]
        assert len({r.spec.checkpoint_dir for r in plan}) == 4
        assert all(r.spec.config.rollout.sd_enabled == (r.spec.mode == "tlt") for r in plan)


def _records(mode: str, steps: int) -> list[dict]:
    step_s = 2.0 if mode == "tlt" else 3.0
    return [{"step": i, "mode": mode, "step_s": step_s, "rollout_s": step_s - 1.0, "logprob_s": 0.0,
             "update_s": 1.0, "weight_sync_s": 0.0, "other_s": 0.0, "drafter_train_s": 0.0,
             "drafter_samples": 0, "sd_steps": int(mode == "tlt"), "mean_accept_len": 2.0, "reward_mean": 0.5,
             "rewards": [0.0, 1.0], "rollout_digest": f"r{i}", "timeline": [[0, "busy", 0.0]], "t_end": 1.0}
            for i in range(steps)]


class FakeLaunch:
    """Records which run folders were launched; interrupts the runs named in `interrupt`."""

    def __init__(self, interrupt: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.interrupt = interrupt

    def __call__(self, spec, run_fn):
        name = str(Path(spec.out_dir).relative_to(Path(spec.config.run_dir)))
        self.calls.append(name)
        steps = spec.config.steps
        status = "interrupted" if name in self.interrupt else "completed"
        recs = _records(spec.mode, 1 if status == "interrupted" else steps)
        return {"mode": spec.mode, "status": status, "records": recs, "next_step": len(recs), "wall_s": 1.0,
                "out_dir": spec.out_dir, "checkpoint_dir": str(spec.checkpoint_dir)}


def _args(run_dir: Path, *extra: str) -> list[str]:
    # the fake runs' records hold 2 rewards per step: one prompt group of 2
    return [str(DEMO), f"run_dir={run_dir}", "steps=3", "progress=false", "model.target_dir=t",
            "model.drafter_dir=d", "grpo.group_size=2", *extra]


def test_interrupted_pairs_resume_skipping_finished_runs(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    first = FakeLaunch(interrupt=("pair1/baseline",))
    monkeypatch.setattr(train_cli, "launch", first)
    assert main([*_args(run_dir), "--compare-baseline", "--pairs", "2"]) == train_cli.EXIT_INTERRUPTED
    assert first.calls == ["pair1/tlt", "pair1/baseline"]
    assert "resume=true --compare-baseline --pairs 2" in capsys.readouterr().err
    partial = json.loads((run_dir / "report.json").read_text())
    assert [r["status"] for r in partial["runs"]] == ["completed", "interrupted"] and "speedup" not in partial

    again = FakeLaunch()
    monkeypatch.setattr(train_cli, "launch", again)
    assert main([*_args(run_dir, "resume=true"), "--compare-baseline", "--pairs", "2"]) == 0
    assert again.calls == ["pair1/baseline", "pair2/baseline", "pair2/tlt"]  # pair1/tlt had finished
    out = capsys.readouterr().out
    assert "tlt (pair 1): completed before, skipped" in out
    assert "baseline, tlt" in out and "median" in out
    report = json.loads((run_dir / "report.json").read_text())
    assert [p["order"] for p in report["pairs"]] == [["tlt", "baseline"], ["baseline", "tlt"]]
    assert report["speedup"] == pytest.approx(1.5) and report["control_ratio"] == pytest.approx(1.0)
    assert report["noisy"] is False and report["rewards_identical"] and report["rollouts_identical"]
    assert [(r["pair"], r["mode"]) for r in report["runs"]] == [(1, "tlt"), (1, "baseline"), (2, "baseline"),
                                                                 (2, "tlt")]
    assert all(Path(p).stat().st_size > 0 for p in report["plots"].values())

    # a finished run is skipped only with resume=true and when it ran all the steps asked for
    more = FakeLaunch()
    monkeypatch.setattr(train_cli, "launch", more)
    assert main([*_args(run_dir, "resume=true", "steps=4"), "--compare-baseline", "--pairs", "1"]) == 0
    assert more.calls == ["pair1/tlt", "pair1/baseline"]
    fresh = FakeLaunch()
    monkeypatch.setattr(train_cli, "launch", fresh)
    assert main([*_args(run_dir), "--compare-baseline", "--pairs", "1"]) == 0
    assert fresh.calls == ["pair1/tlt", "pair1/baseline"]


def test_noisy_control_is_reported(tmp_path, monkeypatch, capsys):
    def slow_baseline_update(spec, run_fn):
        summary = FakeLaunch()(spec, run_fn)
        for r in summary["records"]:
            r["update_s"] = 1.3 if spec.mode == "baseline" else 1.0
        return summary

    monkeypatch.setattr(train_cli, "launch", slow_baseline_update)
    assert main([*_args(tmp_path / "run"), "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["noisy"] is True and report["control_ratio"] == pytest.approx(1.3)
    assert "too noisy" in report["note"] and "too noisy" in capsys.readouterr().out


def test_sampled_runs_report_per_token_figures_and_reward_intervals(tmp_path, monkeypatch, capsys):
    """Runs that drew different tokens (rejection sampling): per-token figures, the
    sampling note, the reward difference with its interval and the reward-curve plot."""
    def sampled(spec, run_fn):
        summary = FakeLaunch()(spec, run_fn)
        for r in summary["records"]:
            r.update(tokens=100 if spec.mode == "tlt" else 130, rollout_digest=f"{spec.mode}{r['step']}",
                     update_s=1.0 if spec.mode == "tlt" else 1.3, rewards=[0.0, 1.0, 1.0, 0.0])
        return summary

    monkeypatch.setattr(train_cli, "launch", sampled)
    assert main([*_args(tmp_path / "run"), "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert not report["rollouts_identical"] and report["sampling_note"]
    assert report["control_ratio_per_token"] == pytest.approx(1.0) and report["noisy"] is False
    assert report["reward_curves"]["reward_difference"]["mean"] == 0.0
    assert Path(report["plots"]["reward_curves"]).stat().st_size > 0
    out = capsys.readouterr().out
    assert "speedup per response token" in out and "control ratio per prompt + response token 1.00" in out
    assert "NOTE: the runs drew different" in out
    assert "mean reward TLT - baseline over all steps" in out and "contains 0" in out


def test_a_task_that_does_not_import_is_refused_before_any_worker_starts(tmp_path, capsys):
    rc = main([str(DEMO), f"run_dir={tmp_path}", "task.reward=no_such_module_for_tlt:score", "progress=false"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "task.reward='no_such_module_for_tlt:score': cannot import module" in err


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_trtllm_engine_without_the_package_stops_before_any_work(tmp_path):
    """The real command: exit 2 naming the extra and what the demo config asks that
    TensorRT-LLM cannot express, no traceback, and nothing started (the resolved config,
    printed before the models load, is not printed; no run folder is made)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nemo_tlt.cli", "train", str(DEMO), "rollout.engine=trtllm",
                           f"run_dir={run_dir}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert TRTLLM_INSTALL in proc.stderr and TRTLLM_REQUIREMENT in proc.stderr
    assert "grpo.acceptance=coupled" in proc.stderr and "rollout.sd_enabled" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "" and "run folder" not in proc.stderr
    assert not run_dir.exists()
