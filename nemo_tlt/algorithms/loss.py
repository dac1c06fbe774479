"""Policy-gradient loss math: token log-probs, the clipped policy-gradient loss, KL penalties.

Pure functions over tensors; the policy backends hold the state (GRPO's group
advantages are in ``nemo_tlt.algorithms``). Shapes: ``B`` sequences,
``T`` response tokens, ``V`` vocabulary. ``mask[B, T]`` is 1 on response tokens
that count (generated, not padding) and 0 elsewhere; every token average is a
*token mean* over the masked tokens of the whole batch,

    masked_mean(x, m) = sum(x * m) / max(sum(m), 1),

so long responses weigh in proportion to their length (the DAPO convention) and a
batch with no valid token gives 0 rather than NaN.
"""
from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps k3 finite when the policies are far apart


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1), a scalar.

    Masked-out entries are selected away rather than multiplied by 0, so padding
    holding inf or NaN (e.g. log-probs of pad tokens) cannot poison the mean.
    """
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros_like(values)).sum()
    return total / keep.sum().clamp(min=1).to(values.dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., targets]: ``logits[..., V]``, ``targets[...]`` -> ``[...]``.

    Computed in float32 as ``logit[target] - logsumexp(logits)``, which avoids
    materialising the full log-softmax.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_logprobs: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree"
        )
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def clipped_pg_loss(
    logp_new: torch.Tensor,    # [B, T] float32, with grad
    logp_old: torch.Tensor,    # [B, T] float32, the rollout policy's
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,        # [B, T], 1 on counted response tokens
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # (scalar loss, {"clip_frac", ...})
    """PPO-style clipped surrogate, token mean over masked tokens.

    With ratio rho = exp(logp_new - logp_old) per token and advantage A
    (``[B]`` per sequence, broadcast over tokens, or ``[B, T]``):

        loss = masked_mean( -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) )

    ``eps_high`` defaults to ``clip_eps`` (symmetric clipping; DAPO raises it).
    Gradient flows only through ``logp_new`` and only where the unclipped term is
    the minimum. Stats (floats): ``clip_frac`` (masked tokens where the clipped
    term is strictly smaller, i.e. no gradient), ``approx_kl`` (masked mean of
    logp_old - logp_new), ``ratio_mean``, ``num_tokens``.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0 < clip_eps < 1:
        raise ValueError(f"clipped_pg_loss: clip_eps must be in (0, 1), got {clip_eps}")
    if eps_high <= 0:
        raise ValueError(f"clipped_pg_loss: clip_eps_high must be > 0, got {eps_high}")
    if logp_new.shape != logp_old.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"clipped_pg_loss: logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if advantages.dim() == 1 and logp_new.dim() == 2:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logp_new.dtype).detach()
    # Select padding away before exp(), so inf / NaN there cannot reach the gradient.
    keep = mask.bool()
    log_ratio = torch.where(keep, logp_new - logp_old.detach(), torch.zeros_like(logp_new))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * advantages
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).to(ratio.dtype), mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, stats


def kl_per_token(logp_new: torch.Tensor, logp_ref: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimators of KL(pi_new || pi_ref) from samples of pi_new.

    With log r = logp_ref - logp_new (clamped to +-20 for stability):

        k1 = -log r                   (unbiased, can be negative)
        k2 = (log r)^2 / 2            (biased, low variance)
        k3 = r - 1 - log r            (unbiased, always >= 0; Schulman's estimator)
    """
    log_r = (logp_ref - logp_new).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"kl_penalty: kind must be one of 'k1', 'k2', 'k3', got {kind!r}")


def kl_penalty(
    logp_new: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Token mean of :func:`kl_per_token` over masked tokens; gradient flows to ``logp_new``."""
    if logp_new.shape != logp_ref.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"kl_penalty: logp_new {tuple(logp_new.shape)}, logp_ref {tuple(logp_ref.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    keep = mask.bool()
    log_new = torch.where(keep, logp_new, torch.zeros_like(logp_new))
    log_ref = torch.where(keep, logp_ref.detach(), torch.zeros_like(logp_new))
    return masked_mean(kl_per_token(log_new, log_ref, kind), mask)


def policy_and_kl_loss(algorithm,
                       logp_new: torch.Tensor,                 # [B, T] float32, with grad
                       logp_old: torch.Tensor,                 # [B, T] float32
                       advantages: torch.Tensor,               # [B]
                       mask: torch.Tensor,                     # [B, T]
                       clip_eps: float,
                       logp_ref: torch.Tensor | None = None,   # [B, T] float32, the reference policy's
                       kl_coef: float = 0.0,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:  # scalars, stats
    """One micro-batch's update loss, as both policy backends compute it: ``algorithm``'s
    ``policy_loss`` (token mean over ``mask``), plus ``kl_coef`` x the k3 KL to ``logp_ref`` over the
    same tokens when a reference is given. Returns ``(loss, policy loss, kl or None, its stats)``."""
    pg, stats = algorithm.policy_loss(logp_new, logp_old, advantages, mask, clip_eps)
    if logp_ref is None:
        return pg, pg, None, stats
    kl = kl_penalty(logp_new, logp_ref, mask)
    return pg + kl_coef * kl, pg, kl, stats
