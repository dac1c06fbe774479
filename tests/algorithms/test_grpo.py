"""GRPO math against hand-computed values and gradient checks."""
import math

import pytest
import torch

from nemo_tlt.algorithms.loss import clipped_pg_loss, kl_penalty, kl_per_token, masked_mean, token_logprobs
from nemo_tlt.algorithms.grpo import group_advantages


def test_group_advantages_matches_formula_and_shapes():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    g0 = rewards[:4]
    assert torch.allclose(adv[:4], (g0 - g0.mean()) / g0.std())
    assert torch.equal(adv[4:8], torch.zeros(4))  # zero-variance group: exactly zero
    assert adv[8:].sum().abs() < 1e-6 and adv[8] > 0 > adv[11]
    adv2d = group_advantages(rewards.reshape(3, 4), group_size=4, eps=0.0)
    assert adv2d.shape == (3, 4) and torch.allclose(adv2d.reshape(-1), adv)


def test_group_advantages_zero_variance_is_exact_even_with_float_noise():
    # 0.1 repeated: the mean differs from 0.1 by rounding; dividing that by eps would explode.
    rewards = torch.full((2, 7), 0.1)
    assert torch.equal(group_advantages(rewards, 7), torch.zeros(2, 7))
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0]), 1), torch.zeros(2))


def test_group_advantages_without_std_scaling_and_validation():
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="G=3"):
        group_advantages(torch.ones(2, 3), 2)


def test_token_logprobs_matches_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    targets = torch.randint(11, (2, 5), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, targets), expected.float(), atol=1e-6)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(logits, targets[:, :4])


def _pg(logp_new, logp_old, adv, mask, **kw):
    logp_new = logp_new.clone().requires_grad_(True)
    loss, stats = clipped_pg_loss(logp_new, logp_old, adv, mask, **kw)
    loss.backward()
    return loss, stats, logp_new.grad


def test_clipping_on_both_sides_stops_the_gradient():
    eps = 0.2
    logp_old = torch.zeros(1, 4)
    # ratios: 1.5 (above 1+eps), 0.5 (below 1-eps), 1.1 and 0.9 (inside)
    logp_new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]]))
    mask = torch.ones(1, 4)
    # Positive advantage: the high ratio is clipped (no grad), the low one is not.
    loss, stats, grad = _pg(logp_new, logp_old, torch.tensor([1.0]), mask, clip_eps=eps)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.1 + 0.9) / 4, rel=1e-5)
    assert grad[0, 0] == 0 and grad[0, 1] != 0 and grad[0, 2] != 0
    assert stats["clip_frac"] == pytest.approx(0.25)
    # Negative advantage: the low ratio is clipped, the high one is not.
    loss, stats, grad = _pg(logp_new, logp_old, torch.tensor([-1.0]), mask, clip_eps=eps)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1 + 0.9) / 4, rel=1e-5)
    assert grad[0, 1] == 0 and grad[0, 0] != 0
    assert stats["clip_frac"] == pytest.approx(0.25)
    # Gradient of -rho * A / n wrt logp is -rho * A / n where unclipped.
    assert grad[0, 0].item() == pytest.approx(1.5 / 4, rel=1e-5)


def test_asymmetric_clip_high():
    logp_new = torch.log(torch.tensor([[1.25]]))
    _, stats, grad = _pg(logp_new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                         clip_eps=0.2, clip_eps_high=0.28)
    assert stats["clip_frac"] == 0.0 and grad[0, 0] != 0


def test_masking_excludes_padded_tokens():
    gen = torch.Generator().manual_seed(1)
    logp_new = -torch.rand(2, 6, generator=gen)
    logp_old = -torch.rand(2, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.7, -1.3])
    loss, stats, grad = _pg(logp_new, logp_old, adv, mask)
    # Garbage (even inf / nan) in padded slots changes nothing.
    dirty_new = torch.where(mask.bool(), logp_new, torch.tensor(float("nan")))
    dirty_old = torch.where(mask.bool(), logp_old, torch.tensor(float("-inf")))
    loss2, stats2, grad2 = _pg(dirty_new, dirty_old, adv, mask)
    assert torch.allclose(loss, loss2) and stats["num_tokens"] == stats2["num_tokens"] == 6
    assert torch.equal(grad2[~mask.bool()], torch.zeros(6)) and torch.equal(grad[~mask.bool()], torch.zeros(6))
    assert torch.allclose(grad[mask.bool()], grad2[mask.bool()])
    # Token mean: equal to the mean over the six real tokens of the per-token loss.
    ratio = torch.exp(logp_new - logp_old)
    per_tok = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    assert loss.item() == pytest.approx(per_tok[mask.bool()].mean().item(), rel=1e-6)


def test_no_gradient_to_old_logprobs_or_advantages():
    logp_old = torch.zeros(1, 3, requires_grad=True)
    adv = torch.ones(1, 3, requires_grad=True)
    logp_new = torch.full((1, 3), -0.05, requires_grad=True)
    loss, _ = clipped_pg_loss(logp_new, logp_old, adv, torch.ones(1, 3))
    loss.backward()
    assert logp_old.grad is None and adv.grad is None and logp_new.grad is not None


def test_empty_mask_gives_zero_not_nan():
    loss, stats = clipped_pg_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and stats["num_tokens"] == 0
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


def test_kl_estimators():
    logp_new = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    logp_ref = torch.log(torch.tensor([[0.25, 0.2, 0.3]]))
    log_r = logp_ref - logp_new
    assert torch.allclose(kl_per_token(logp_new, logp_ref, "k1"), -log_r)
    assert torch.allclose(kl_per_token(logp_new, logp_ref, "k2"), 0.5 * log_r ** 2)
    k3 = kl_per_token(logp_new, logp_ref, "k3")
    assert torch.allclose(k3, log_r.exp() - 1 - log_r) and (k3 >= 0).all() and k3[0, 1] == 0
    with pytest.raises(ValueError, match="kind"):
        kl_per_token(logp_new, logp_ref, "k4")


def test_kl_penalty_masks_and_flows_only_to_new():
    logp_new = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -1.0, -50.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl = kl_penalty(logp_new, logp_ref, mask, kind="k3")
    expected = sum(math.exp(d) - 1 - d for d in (-0.5, 1.0)) / 2
    assert kl.item() == pytest.approx(expected, rel=1e-6)
    kl.backward()
    assert logp_ref.grad is None and logp_new.grad[0, 2] == 0 and logp_new.grad[0, 0] != 0


def test_k3_is_an_unbiased_kl_estimate():
    # E_{x ~ p}[k3] = KL(p || q) for categorical p, q.
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    k3 = kl_per_token(p.log(), q.log(), "k3")
    assert (p * k3).sum().item() == pytest.approx((p * (p / q).log()).sum().item(), rel=1e-5)
