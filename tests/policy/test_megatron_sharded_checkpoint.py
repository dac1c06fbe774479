"""Sharded policy checkpoints (megatron-core dist_checkpointing, gloo, CPU): a policy trained
at TP2 x DP2 (4 ranks) and checkpointed after its first update resumes at TP2 x DP1 (2 ranks),
and its next update equals the uninterrupted 4-rank run's: loss and grad norm within 1e-6
relative, every updated weight within 1e-6 (fp32; the only difference is the order of the
gradient sums over the data-parallel split). A TP whose padded vocabulary differs is refused
with both layouts named."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from megatron_checkpoint_workers import checkpoint_then_continue, resume_and_continue  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig  # noqa: E402
from test_megatron_backend import LLAMA, _batch, _weights  # noqa: E402

OPTIM = PolicyOptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.5)


def _policy(tp: int, pp: int = 1) -> PolicyConfig:
    return PolicyConfig(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp, micro_batch=2, optim=OPTIM)


@pytest.mark.timeout(180)
def test_checkpoint_at_four_ranks_resumes_at_two(tmp_path):
    canonical = _weights(LLAMA, seed=3)
    batches = [_batch(11, n=6), _batch(12, n=6)]
    ckpt = str(tmp_path / "policy")
    whole = launch_forked(checkpoint_then_continue, 4, LLAMA, canonical, _policy(2), batches, ckpt,
                         timeout_s=150)[0]
    resumed = launch_forked(resume_and_continue, 2, LLAMA, canonical, _policy(2), batches, ckpt, None, _policy(1),
                           timeout_s=150)[0]
    assert resumed["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert resumed["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6)
    moved = 0.0
    for name, want in whole["canonical"].items():
        torch.testing.assert_close(resumed["canonical"][name], want, rtol=0, atol=1e-6, msg=name)
        moved = max(moved, float((want - canonical[name]).abs().max()))
    assert moved > 1e-3  # two updates really moved the weights: the comparison is not vacuous
    assert "TP=2" in resumed["refusal"] and "TP=1" in resumed["refusal"]


@pytest.mark.timeout(180)
def test_kill_during_sharded_save_leaves_previous_checkpoint_loadable(tmp_path):
    from megatron_checkpoint_workers import load_latest, save_then_die

    canonical = _weights(LLAMA, seed=4)
    batches = [_batch(21, n=4), _batch(22, n=4)]
    root, reference = tmp_path / "ckpt", tmp_path / "step1.pt"
    with pytest.raises(Exception):
        launch_forked(save_then_die, 2, LLAMA, canonical, _policy(2), batches, str(root), str(reference),
                     timeout_s=150)
    assert (root / ".step-00000002.partial-sharded").is_dir()  # the killed save's files, never committed
    assert not (root / "step-00000002").exists()
    got = launch_forked(load_latest, 2, LLAMA, canonical, _policy(2), str(root), timeout_s=150)[0]
    assert got["step"] == 1 and got["policy_step"] == 1
    want = torch.load(reference)
    for name, tensor in want.items():
        assert torch.equal(got["weights"][name], tensor), name


@pytest.mark.timeout(180)
def test_async_save_holds_the_state_of_its_start_while_the_policy_steps_on(tmp_path):
    """``start_save_sharded`` returns while the shard is written; the policy's next update runs
    meanwhile, its optimizer step only after the writers ended (the step rewrites every page
    they share). Resumed from that checkpoint at 2 ranks, step 2 equals the uninterrupted run's."""
    from megatron_checkpoint_workers import async_checkpoint_during_step

    canonical = _weights(LLAMA, seed=5)
    batches = [_batch(31, n=6), _batch(32, n=6)]
    ckpt = str(tmp_path / "policy")
    whole = launch_forked(async_checkpoint_during_step, 4, LLAMA, canonical, _policy(2), batches, ckpt,
                         timeout_s=150)[0]
    assert whole["finished_by_step"]
    resumed = launch_forked(resume_and_continue, 2, LLAMA, canonical, _policy(2), batches, ckpt, timeout_s=150)[0]
    assert resumed["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert resumed["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6)
    for name, want in whole["canonical"].items():
        torch.testing.assert_close(resumed["canonical"][name], want, rtol=0, atol=1e-6, msg=name)
