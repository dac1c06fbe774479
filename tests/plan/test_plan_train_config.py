"""A plan is refused where it assumes what the training run it names will not do: each field
``check_train_config`` compares, changed on one side only, names both keys and both values.
The training config is the shipped 32B one, written back with one key changed."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.plan.config import load_plan_config

CONF = Path(__file__).resolve().parents[2] / "conf"
PLAN, TRAIN = CONF / "qwen2.5-32b_plan.yaml", CONF / "qwen2.5-32b_grpo.yaml"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(CONF.parent)


def _plan(tmp_path: Path, train: list[str] = [], plan: list[str] = []):
    """The shipped plan (with ``plan`` overrides) against the shipped training config (with ``train`` ones)."""
    path = tmp_path / "train.yaml"
    path.write_text(load_config(TRAIN, train).to_yaml())
    return load_plan_config(PLAN, [f"train_config={path}", *plan])


def test_the_shipped_pair_agrees(tmp_path):
    assert _plan(tmp_path).rollout.tensor_parallel == 4


def test_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"plan dtype='bfloat16' disagrees with .*train\.yaml: model\.dtype='float32'"):
        _plan(tmp_path, train=["model.dtype=float32"])


def test_distributed_optimizer(tmp_path):
    with pytest.raises(ValueError, match=r"plan training\.distributed_optimizer=False disagrees with .*: "
                                         r"policy\.backend='megatron' runs with distributed_optimizer=True"):
        _plan(tmp_path, plan=["training.distributed_optimizer=false"])
    torch_run = ["policy.backend=torch", "policy.tensor_parallel=1", "policy.sequence_parallel=false",
                 "policy.recompute=none"]
    torch_plan = ["training.tensor_parallel=1", "training.sequence_parallel=false", "training.recompute=none"]
    with pytest.raises(ValueError, match=r"plan training\.distributed_optimizer=True disagrees with .*: "
                                         r"policy\.backend='torch' runs with distributed_optimizer=False"):
        _plan(tmp_path, train=torch_run, plan=torch_plan)
    assert not _plan(tmp_path, train=torch_run, plan=[*torch_plan, "training.distributed_optimizer=false"]
                     ).training.distributed_optimizer


def test_recompute(tmp_path):
    with pytest.raises(ValueError, match=r"plan training\.recompute='full' disagrees with .*: "
                                         r"policy\.recompute='selective'"):
        _plan(tmp_path, train=["policy.recompute=selective"])
    assert _plan(tmp_path, train=["policy.recompute=selective"], plan=["training.recompute=selective"])


def test_sequence_parallel(tmp_path):
    with pytest.raises(ValueError, match=r"plan training\.sequence_parallel=True disagrees with .*: "
                                         r"policy\.sequence_parallel=False"):
        _plan(tmp_path, train=["policy.sequence_parallel=false"])


def test_rollout_tensor_parallel(tmp_path):
    with pytest.raises(ValueError, match=r"plan rollout\.tensor_parallel=8 disagrees with .*: "
                                         r"rollout\.tensor_parallel=4"):
        _plan(tmp_path, plan=["rollout.tensor_parallel=8"])
    with pytest.raises(ValueError, match=r"plan rollout\.tensor_parallel=4 disagrees with .*: "
                                         r"rollout\.tensor_parallel=2"):
        _plan(tmp_path, train=["rollout.tensor_parallel=2"])


def test_training_state(tmp_path):
    """The run's rollout.training_state is what the plan keeps on the GPU during the rollout:
    ``offload`` (the shipped pair) is the plan's ``offload``, ``resident`` its ``all``; the plan's
    ``weights`` is no run's."""
    assert _plan(tmp_path).rollout.training_state == "offload"
    with pytest.raises(ValueError, match=r"plan rollout\.training_state='offload' disagrees with .*: "
                                         r"rollout\.training_state='resident' runs with training_state='all'"):
        _plan(tmp_path, train=["rollout.training_state=resident"])
    assert _plan(tmp_path, train=["rollout.training_state=resident"], plan=["rollout.training_state=all"])
    with pytest.raises(ValueError, match=r"plan rollout\.training_state='weights' disagrees with .*: "
                                         r"rollout\.training_state='offload' runs with training_state='offload'"):
        _plan(tmp_path, plan=["rollout.training_state=weights"])


def test_gradient_bytes(tmp_path):
    with pytest.raises(ValueError, match=r"plan training\.grad_bytes=2 disagrees with .*: "
                                         r"policy\.backend='megatron' runs with grad_bytes=4"):
        _plan(tmp_path, plan=["training.grad_bytes=2"])


def test_a_float32_plan_is_refused_as_not_modelled():
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16'\].*got 'float32'"):
        load_plan_config(PLAN, ["dtype=float32", "train_config=null"])
