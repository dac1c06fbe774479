"""Run checkpoints: what is saved comes back exactly; another world size or mode is refused."""
import pytest
import torch

from nemo_tlt.rl.reporting.records import RankState
from nemo_tlt.rl.state.run_checkpoint import RunCheckpointer, RunState


def _state(mode="tlt", world=2):
    drafter = {"w": torch.arange(4.0)} if mode == "tlt" else None
    return RunState(step=3, mode=mode, world=world, policy_weights={"a": torch.ones(2, 3)},
                    policy_states=[{"optimizer": {"state": {}, "param_groups": []}, "step": 4}],
                    ranks=[RankState({"x": 1}, [1, 2]), RankState({"x": 2}, [3, 4])],
                    records=[{"step": 3, "reward_mean": 0.5}], drafter_weights=drafter,
                    drafter_trainer={"step": 7} if drafter else None)


def test_round_trip_and_refusals(tmp_path):
    writer = RunCheckpointer(tmp_path, writer=True)
    writer.save(_state())
    writer.close()
    back = RunCheckpointer(tmp_path).load_latest(world=2, mode="tlt")
    assert back.step == 3 and back.ranks == [RankState({"x": 1}, [1, 2]), RankState({"x": 2}, [3, 4])]
    assert torch.equal(back.policy_weights["a"], torch.ones(2, 3)) and torch.equal(back.drafter_weights["w"],
                                                                                   torch.arange(4.0))
    assert back.policy_states[0]["step"] == 4 and back.drafter_trainer == {"step": 7}
    assert back.records == [{"step": 3, "reward_mean": 0.5}]
    with pytest.raises(ValueError, match="written by 2 workers; workers.num_workers=4"):
        RunCheckpointer(tmp_path).load_latest(world=4, mode="tlt")
    with pytest.raises(ValueError, match="is a tlt run's checkpoint; this run is baseline"):
        RunCheckpointer(tmp_path).load_latest(world=2, mode="baseline")
    assert RunCheckpointer(tmp_path / "empty").load_latest(world=2, mode="tlt") is None


def test_a_sharded_checkpoint_is_refused_by_name_not_ignored(tmp_path):
    # a megatron run on several workers checkpoints into <dir>/sharded; resuming it with an
    # unsharded policy state must not silently start again at step 0
    (tmp_path / "sharded" / "step-00000003").mkdir(parents=True)
    with pytest.raises(ValueError, match="sharded policy state"):
        RunCheckpointer(tmp_path).load_latest(world=2, mode="tlt")


def test_close_all_closes_every_one_and_reraises_the_first_error():
    from nemo_tlt.rl.state.run_saver import close_all

    closed = []

    class Ok:
        def close(self):
            closed.append("ok")

    class Fails:
        def close(self):
            closed.append("fails")
            raise RuntimeError("peer died")

    import pytest
    with pytest.raises(RuntimeError, match="peer died"):
        close_all(Ok(), None, Fails(), Ok())
    assert closed == ["ok", "fails", "ok"]
