"""Sharded run checkpoints of the megatron policy in the RL loop (gloo, CPU, the tiny models):

* a TLT run at 4 workers (TP2 x DP2) checkpointed after step 1 resumes at 2 workers
  (TP2 x DP1), and its next step equals the uninterrupted 4-worker run's: the same rollouts
  and rewards, grad norm and loss within 1e-6 relative, every policy weight within 1e-6
  (the tolerance of the backend-level test: only the order of the gradient sums over the
  data-parallel split differs). Resuming at TP1 is refused, naming both layouts.
* a rank killed (SIGKILL) while its shard of step 1 is written, before the commit (which
  the asynchronous save defers to the next checkpoint or the end of the run), leaves
  step 0's checkpoint the newest loadable one: the resumed run redoes step 1 exactly as the
  killed run had logged it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from nemo_tlt.config import load_config
from nemo_tlt.rl.loop import run_rank
from nemo_tlt.rl.run import RunSpec, prepare_run_dir
from nemo_tlt.rl.workers import launch

from tiny_rl import tiny_overrides
from .test_resume import _sharded_latest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(180)
STEPS = 3
MEGATRON = ("policy.backend=megatron", "policy.pipelined_update=false", "policy.micro_batch_tokens=0")


def _spec(run_dir, target, drafter, workers: int, tp: int = 2, resume: bool = False, every: int = 1) -> RunSpec:
    overrides = tiny_overrides(target, drafter, run_dir, steps=STEPS, workers=workers)
    cfg = load_config(None, overrides + [*MEGATRON, f"policy.tensor_parallel={tp}", f"resume={str(resume).lower()}",
                                         f"checkpoint.every={every}"])
    spec = RunSpec(cfg, "tlt", str(run_dir / "tlt"), str(target), str(drafter))
    prepare_run_dir(spec)
    return spec


def _weights(tensors: dict) -> dict:
    """The policy's weights (not the optimizer's state) of a ``_sharded_latest`` dict."""
    return {k: v for k, v in tensors.items() if not k.startswith("optimizer") and "_extra_state" not in k}


def test_checkpoint_at_four_workers_resumes_at_two(tiny_models, tmp_path):
    target, drafter = tiny_models
    # checkpoint.every=2: the step-1 checkpoint resumed from below and the last one, not step 0's,
    # which nothing reads (a save of 4 ranks costs ~4 s here); step 1's save is still committed
    # by the next one, as every=1's are
    full = launch(_spec(tmp_path / "full", target, drafter, workers=4, every=2), run_rank)
    assert full["status"] == "completed" and [r["step"] for r in full["records"]] == [0, 1, 2]
    # the uninterrupted run's step-1 checkpoint alone, in a fresh run folder
    src = tmp_path / "full" / "tlt" / "checkpoints" / "sharded" / "step-00000001"
    shutil.copytree(src, tmp_path / "resumed" / "tlt" / "checkpoints" / "sharded" / src.name)
    _, at_step1 = _sharded_latest(tmp_path / "resumed")

    resumed = launch(_spec(tmp_path / "resumed", target, drafter, workers=2, resume=True), run_rank)
    assert resumed["status"] == "completed" and [r["step"] for r in resumed["records"]] == [0, 1, 2]
    want, got = full["records"][2], resumed["records"][2]
    assert got["rollout_digest"] == want["rollout_digest"] and got["rewards"] == want["rewards"]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-9)
    assert got["replicas_identical"]

    _, final_full = _sharded_latest(tmp_path / "full")
    _, final_resumed = _sharded_latest(tmp_path / "resumed")
    weights, moved = _weights(final_full), 0.0
    assert weights and sorted(weights) == sorted(_weights(final_resumed))
    for name, w in weights.items():
        torch.testing.assert_close(final_resumed[name], w, rtol=0, atol=1e-6, msg=name)
        moved = max(moved, float((w - at_step1[name]).abs().max()))
    assert moved > 1e-4  # step 2 really moved the weights: the comparison is not vacuous

    with pytest.raises(RuntimeError, match=r"TP=2 x PP=1.*TP=1 x PP=1"):
        launch(_spec(tmp_path / "resumed", target, drafter, workers=2, tp=1, resume=True), run_rank)


def test_kill_during_sharded_run_checkpoint_leaves_previous_loadable(tiny_models, tmp_path, monkeypatch):
    import torch.distributed as dist

    from nemo_tlt.policy.megatron_backend import MegatronPolicy

    start = MegatronPolicy.start_save_sharded

    def save_then_die(self, directory: str):  # runs in the forked workers
        pending = start(self, directory)
        if "step-00000001" in directory and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # its shard being written, the commit not reached
        return pending

    target, drafter = tiny_models
    run = tmp_path / "run"
    monkeypatch.setattr(MegatronPolicy, "start_save_sharded", save_then_die)
    with pytest.raises(RuntimeError):
        launch(_spec(run, target, drafter, workers=2), run_rank)
    monkeypatch.undo()
    ckpts = run / "tlt" / "checkpoints" / "sharded"
    assert not (ckpts / "step-00000001").exists() and (ckpts / "step-00000000").is_dir()
    assert (ckpts / ".step-00000001.partial-sharded" / "policy").is_dir()  # the killed save's files
    logged = [json.loads(line) for line in (run / "tlt" / "metrics.jsonl").read_text().splitlines()]
    killed_step1 = next(r for r in logged if r.get("step") == 1 and "rollout_digest" in r)

    resumed = launch(_spec(run, target, drafter, workers=2, resume=True), run_rank)
    assert resumed["status"] == "completed" and [r["step"] for r in resumed["records"]] == [0, 1, 2]
    redo = resumed["records"][1]
    assert redo["run_started"] != killed_step1["run_started"]  # step 1 was run again, from step 0's checkpoint
    assert redo["rollout_digest"] == killed_step1["rollout_digest"] and redo["rewards"] == killed_step1["rewards"]
    assert redo["grad_norm"] == killed_step1["grad_norm"] and redo["policy_digest"] == killed_step1["policy_digest"]
