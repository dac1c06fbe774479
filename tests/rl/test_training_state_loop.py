"""``rollout.training_state=offload`` in the RL loop (2 steps, 2 workers, the demo config's
pipelined update): the policy's training state leaves the device before every rollout and
comes back before the update, TLT reloading before it claims its first piece in the rollout's
tail and the baseline after the meet, and the run learns exactly what a resident run learns:
the same rollouts, rewards, losses and policy weights, step by step. The moves are timed in
each record (``offload_s``, ``reload_s``) and counted in ``other_s``, not in ``rollout_s``
(shown with an offload slowed down by 0.2 s)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.policy.torch_backend import TorchPolicy
from nemo_tlt.rl.training_state import TrainingState
from nemo_tlt.train import main
from tiny_rl import tiny_overrides

pytestmark = pytest.mark.timeout(180)
YAML = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
SAME = ("rollout_digest", "rewards", "loss", "pg_loss", "kl", "grad_norm", "loss_tokens", "policy_digest")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_offloaded_training_state_learns_what_a_resident_one_learns(tiny_models, tmp_path, monkeypatch):
    target, drafter = tiny_models
    resident, offload = tmp_path / "resident", tmp_path / "offload"
    assert main([str(YAML), *tiny_overrides(target, drafter, resident, steps=2)]) == 0
    move = TorchPolicy.offload_training_state

    def slow_offload(self):  # the forked workers inherit it
        time.sleep(0.2)
        move(self)
    monkeypatch.setattr(TorchPolicy, "offload_training_state", slow_offload)
    assert main([str(YAML), *tiny_overrides(target, drafter, offload, steps=2), "rollout.training_state=offload",
                 "--compare-baseline", "--pairs", "1"]) == 0
    want = _metrics(resident / "tlt")
    assert load_config(YAML).policy.pipelined_update and load_config(YAML).rollout.training_state == "resident"
    assert all(r["offload_s"] == r["reload_s"] == 0.0 for r in want)
    for mode in ("tlt", "baseline"):
        got = _metrics(offload / "pair1" / mode)
        assert [r["step"] for r in got] == [0, 1]
        for g, w in zip(got, want):
            assert {k: g[k] for k in SAME} == {k: w[k] for k in SAME}, (mode, g["step"])
            assert g["policy_digest"] is not None and g["replicas_identical"]
            assert g["offload_s"] >= 0.2 and g["reload_s"] > 0, mode
            assert g["other_s"] >= g["offload_s"] + g["reload_s"] - 1e-9  # not in rollout_s


def test_the_setting_is_checked_by_name():
    with pytest.raises(ValueError, match=r"rollout.training_state must be one of resident, offload, got 'host'"):
        load_config(YAML, ["rollout.training_state=host"])

    class Plain:  # a backend with the core contract only
        pass

    with pytest.raises(ValueError, match=r"rollout.training_state=offload: the mine policy backend does not "
                                         r"implement OffloadsTrainingState .*missing \['offload_training_state'"):
        TrainingState(Plain(), "offload", "mine")
    resident = TrainingState(Plain(), "resident", "mine")  # nothing asked of the backend, nothing moved
    resident.offload()
    resident.reload()
    assert resident.times() == {"offload_s": 0.0, "reload_s": 0.0, "engine_sleep_s": 0.0}


def test_an_engine_that_sleeps_sleeps_once_a_step_when_the_rollout_is_over():
    """rollout.vllm.enable_sleep_mode: the engine sleeps at the step's first reload (this rank's
    rollout is over), once, its seconds in the record; an engine that does not sleep, or does
    not implement the contract, is left alone."""
    class Engine:
        def __init__(self, sleeps):
            self.sleeps, self.calls = sleeps, 0

        def sleep(self):
            self.calls += 1

    class Plain:
        pass

    engine = Engine(True)
    state = TrainingState(Plain(), "resident", "mine", engine)
    for step in range(2):
        state.offload()
        assert engine.calls == step  # not during the rollout
        state.reload()
        state.reload()
        assert engine.calls == step + 1 and state.times()["engine_sleep_s"] > 0
    idle = Engine(False)
    for other in (idle, Plain()):
        quiet = TrainingState(Plain(), "resident", "mine", other)
        quiet.offload()
        quiet.reload()
        assert quiet.times()["engine_sleep_s"] == 0.0
    assert idle.calls == 0
