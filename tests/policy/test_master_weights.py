"""A bf16 policy trains through fp32 master weights: the optimizer state and the gradient
reduction are fp32, updates smaller than a bf16 ulp accumulate in the masters, the model
holds the masters rounded to bf16, and the masters travel with the checkpoint state."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.device import Placement
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend
from nemo_tlt.policy.master_weights import MasterWeights
from tiny import tiny_config


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = [(torch.randint(3, 32, (3,), generator=g).tolist(), torch.randint(3, 32, (int(r),), generator=g).tolist())
             for r in torch.randint(2, 10, (6,), generator=g)]
    return batch, torch.randn(6, generator=g), sum(int(r) for r in torch.randint(2, 10, (6,), generator=g))


def _policy(dtype: torch.dtype, lr: float = 1e-3):
    cfg = tiny_config()
    weights = DecoderLM(cfg).init_weights_(torch.Generator().manual_seed(0)).state_dict()
    return build_policy_backend(PolicyConfig(micro_batch=4, optim=PolicyOptimConfig(lr=lr)), weights, cfg,
                                temperature=1.0, seed=0, placement=Placement.cpu(dtype))


def _step(policy, seed: int = 1) -> dict:
    batch, adv, _ = _batch(seed)
    return policy.update(batch, adv, None, None, sum(len(r) for _, r in batch))


def test_fp32_parameters_are_their_own_masters():
    params = list(DecoderLM(tiny_config()).parameters())
    master = MasterWeights(params)
    assert not master.mixed and all(m is p for m, p in zip(master.masters, params))
    assert master.state_dict() is None


def test_bf16_policy_steps_fp32_masters_and_holds_their_rounding():
    policy = _policy(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in policy.model.parameters())
    for seed in (1, 2, 3):
        _step(policy, seed)
    state = policy.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    for p, m in zip(policy.params, policy.master.masters):
        assert m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))


def test_updates_below_a_bf16_ulp_accumulate_in_the_masters():
    policy = _policy(torch.bfloat16, lr=1e-6)  # |step| ~ lr, far below bf16's ulp of weights ~ 0.02
    before = [m.detach().clone() for m in policy.master.masters]
    for seed in (1, 2, 3, 4):
        _step(policy, seed)
    changed = sum(int((m.detach() != b).sum()) for m, b in zip(policy.master.masters, before))
    total = sum(b.numel() for b in before)
    # in bf16 itself a step of ~1e-6 leaves every weight above ~1e-4 in magnitude unchanged
    assert changed > 0.95 * total
    moved = max(float((m.detach() - b).abs().max()) for m, b in zip(policy.master.masters, before))
    assert moved < 1e-4  # about 4 steps of lr


def test_bf16_step_tracks_the_fp32_step():
    a, b = _policy(torch.float32), _policy(torch.bfloat16)
    sa, sb = _step(a), _step(b)
    assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 0.05 * sa["grad_norm"]
    assert abs(sa["loss"] - sb["loss"]) <= 0.05 * max(1.0, abs(sa["loss"]))


def test_masters_travel_with_the_state_so_a_resumed_run_continues_exactly():
    run = _policy(torch.bfloat16)
    _step(run, 1)
    saved = run.state_dict()
    weights = {k: v.clone() for k, v in run.canonical_weights()}
    resumed = _policy(torch.bfloat16)
    resumed.load_canonical(weights)
    resumed.load_state_dict(saved)
    _step(run, 2), _step(resumed, 2)
    for m, n in zip(run.master.masters, resumed.master.masters):
        assert torch.equal(m, n)
    for p, q in zip(run.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_set_to_none_hands_the_next_backward_its_gradient_alone():
    """``zero_grads(set_to_none=True)`` (the pipelined update, one micro-batch per term): fp32
    parameters lose their gradients, so the next backward's gradient is the parameter's
    ``grad`` itself (no add to zeros); without it they keep zeroed tensors in place."""
    layer = torch.nn.Linear(8, 8, bias=False)
    master = MasterWeights([layer.weight])
    layer(torch.ones(2, 8)).sum().backward()
    kept = layer.weight.grad
    master.zero_grads()
    assert layer.weight.grad is kept and not kept.any()
    master.zero_grads(set_to_none=True)
    assert layer.weight.grad is None
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    layer(x).pow(2).sum().backward()
    (want,) = torch.autograd.grad(layer(x).pow(2).sum(), layer.weight)
    assert torch.equal(layer.weight.grad, want)


def test_micro_batches_of_a_bf16_step_accumulate_in_fp32():
    """The master gradient is the fp32 sum of each micro-batch's bf16 gradient, in order
    (bit for bit); a bf16 running sum, as a bf16 ``.grad`` keeps it, is measurably off."""
    g = torch.Generator().manual_seed(9)
    layer = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    twin = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)  # the same weights, hooked apart
    twin.load_state_dict(layer.state_dict())
    xs = [torch.randn(4, 64, generator=g).to(torch.bfloat16) for _ in range(64)]
    want = torch.zeros(64, 64)
    for x in xs:  # every micro-batch's own bf16 gradient, summed in fp32
        (grad,) = torch.autograd.grad(layer(x).float().pow(2).sum(), layer.weight)
        want += grad.float()
    master = MasterWeights([layer.weight])
    master.zero_grads()
    for x in xs:
        layer(x).float().pow(2).sum().backward()
    master.grads_to_masters()
    assert torch.equal(master.masters[0].grad, want)
    bf16_sum = MasterWeights([twin.weight], fp32_accumulation=False)
    bf16_sum.zero_grads()
    for x in xs:
        twin(x).float().pow(2).sum().backward()
    bf16_sum.grads_to_masters()
    off = float((bf16_sum.masters[0].grad - want).norm() / want.norm())
    assert 1e-4 < off < 0.1  # rounding, not a wrong gradient


def test_a_checkpoint_of_the_other_dtype_is_refused_naming_model_dtype():
    bf16, fp32 = _policy(torch.bfloat16), _policy(torch.float32)
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16 run cannot continue"):
        bf16.load_state_dict(fp32.state_dict())
    with pytest.raises(ValueError, match=r"model\.dtype=float32 run cannot continue"):
        fp32.load_state_dict(bf16.state_dict())
