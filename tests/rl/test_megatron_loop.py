"""The RL loop with `policy.backend=megatron` (2 data-parallel gloo workers, each a
real megatron-core GPTModel): TLT vs baseline stay identical, and the policy update
agrees with the torch backend's on the same rollouts (the data-parallel layout with its
training state offloaded during every rollout: ``rollout.training_state=offload``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_tlt.config import load_config
from nemo_tlt.train import main
from nemo_tlt.spot.checkpoint import CheckpointManager

from tiny_rl import tiny_overrides

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(180)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


YAML = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"


def _args(target: Path, drafter: Path, run_dir: Path, backend: str, *parallel: str) -> list[str]:
    return [str(YAML), *tiny_overrides(target, drafter, run_dir, steps=2), f"policy.backend={backend}", *parallel,
            "policy.pipelined_update=false", "policy.micro_batch_tokens=0"]


@pytest.fixture(scope="module")
def torch_run(tiny_models, tmp_path_factory) -> Path:
    """The torch-backend run every layout below is compared with: its arguments do not depend on
    the layout, so it runs once for the module (the tests only read its metrics and checkpoint)."""
    run_dir = tmp_path_factory.mktemp("megatron_loop") / "torch"
    assert main(_args(*tiny_models, run_dir, "torch")) == 0
    return run_dir


@pytest.mark.parametrize("tp,pp,state", [(1, 1, "offload"), (2, 1, "resident"), (1, 2, "resident")],
                         ids=["dp2_offload", "tp2", "pp2"])
def test_megatron_backend_matches_torch_backend(tiny_models, torch_run, tmp_path, tp, pp, state):
    target, drafter = tiny_models
    mc = tmp_path / "megatron"
    assert main([*_args(target, drafter, mc, "megatron", f"policy.tensor_parallel={tp}",
                        f"policy.pipeline_parallel={pp}", f"rollout.training_state={state}"),
                 "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((mc / "report.json").read_text())
    assert report["rollouts_identical"] and report["rewards_identical"]
    tlt = _metrics(mc / "pair1" / "tlt")
    assert all(r["replicas_identical"] for r in tlt)
    assert all((r["offload_s"] > 0) == (state == "offload") for r in tlt)
    torch_metrics = _metrics(torch_run / "tlt") if (torch_run / "tlt").is_dir() else _metrics(torch_run)
    # same initial weights and coupled sampling: the first rollout is the same tokens
    assert tlt[0]["rollout_digest"] == torch_metrics[0]["rollout_digest"]
    # one GRPO update on the same rollout (step 0): the weights agree to float tolerance
    w_mc = _policy_at(mc / "pair1" / "tlt", 0)
    w_torch = _policy_at(torch_run / "tlt" if (torch_run / "tlt").is_dir() else torch_run, 0)
    assert w_mc.keys() == w_torch.keys()
    for k in w_torch:
        torch.testing.assert_close(w_mc[k], w_torch[k], atol=1e-4, rtol=1e-3)
    assert any(not torch.equal(w_mc[k], v) for k, v in _initial(target).items()), "policy never changed"


def _policy_at(run: Path, step: int) -> dict[str, torch.Tensor]:
    sharded = run / "checkpoints" / "sharded" / f"step-{step:08d}" / "policy"
    if sharded.is_dir():  # a megatron run on several workers: every rank wrote its shard
        from nemo_tlt.convert import _load_worker
        from ranks import launch_forked

        (run / f"policy-{step}").mkdir()
        launch_forked(_load_worker, 1, str(sharded), None, None, str(run / f"policy-{step}"), timeout_s=120)
        return {f"policy/{k}": v for k, v in load_file(str(run / f"policy-{step}" / "model.safetensors")).items()}
    manager = CheckpointManager(run / "checkpoints")
    try:
        ck = manager.load(step)
    finally:
        manager.close()
    return {k: v for k, v in ck.tensors.items() if k.startswith("policy/")}


def _initial(target: Path) -> dict[str, torch.Tensor]:
    return {f"policy/{k}": v for k, v in load_file(str(target / "model.safetensors")).items()}


@pytest.mark.parametrize("overrides,match", [
    (["policy.backend=jax"], "policy.backend"),
    (["policy.tensor_parallel=2"], "need policy.backend=megatron"),
    (["policy.backend=megatron", "policy.tensor_parallel=4"], "multiple of"),
    (["policy.backend=megatron", "workers.num_workers=1", "grpo.prompts_per_step=1"], "num_workers >= 2"),
    (["policy.backend=megatron", "policy.pipelined_update=true"], "pipelined_update=true needs policy.backend=torch"),
    (["policy.pipelined_update=maybe"], "policy.pipelined_update"),
])
def test_bad_policy_block(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
