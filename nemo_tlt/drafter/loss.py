"""Drafter losses as pure functions.

EAGLE (Li et al., 2024): the drafter predicts the target's next final hidden state;
the loss is a feature regression (smooth L1) plus a cross-entropy of the drafter's
token distribution against the *target's* distribution at the same position, both
read through the target's frozen LM head W:

    L = w_reg * smoothL1(f_hat, f) + w_ce * CE(softmax(W f), log_softmax(W f_hat))

Medusa: head k at position t is trained against the target's distribution at
position t+k+1 (the one that predicts x[t+k+2]).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cross_entropy(pred_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """-sum_v p_target(v) log p_pred(v), per row."""
    return -(target_logits.float().softmax(-1) * pred_logits.float().log_softmax(-1)).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def eagle_loss(pred_feat: torch.Tensor, target_feat: torch.Tensor, lm_head_weight: torch.Tensor,
               mask: torch.Tensor, reg_weight: float = 1.0, ce_weight: float = 0.1
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """pred_feat, target_feat: [..., H]; mask: [...] bool. Returns (loss, stats)."""
    target_feat = target_feat.to(pred_feat.dtype)
    reg = F.smooth_l1_loss(pred_feat, target_feat, reduction="none").mean(-1)
    # the target's head runs in its own dtype (bf16 for a bf16 target); the loss in fp32
    pred_logits = F.linear(pred_feat.to(lm_head_weight.dtype), lm_head_weight)
    with torch.no_grad():
        target_logits = F.linear(target_feat.to(lm_head_weight.dtype), lm_head_weight)
    ce = soft_cross_entropy(pred_logits, target_logits)
    loss = reg_weight * masked_mean(reg, mask) + ce_weight * masked_mean(ce, mask)
    with torch.no_grad():
        top1 = masked_mean((pred_logits.argmax(-1) == target_logits.argmax(-1)).float(), mask)
        stats = {"reg": float(masked_mean(reg, mask)), "ce": float(masked_mean(ce, mask)), "top1": float(top1)}
    return loss, stats


def medusa_loss(head_feat: torch.Tensor, features: torch.Tensor, lm_head_weight: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """head_feat: [B, T, K, H] heads applied to features [B, T, H]; mask [B, T] marks
    valid feature positions. Head k at t is scored against the target at t+k+1."""
    B, T, K, _ = head_feat.shape
    with torch.no_grad():
        target_logits = F.linear(features.to(lm_head_weight.dtype), lm_head_weight)
    losses, tops = [], []
    for k in range(K):
        shift = k + 1
        if shift >= T:
            break
        pred = F.linear(head_feat[:, : T - shift, k].to(lm_head_weight.dtype), lm_head_weight)
        tgt = target_logits[:, shift:]
        m = mask[:, shift:] & mask[:, : T - shift]
        losses.append(masked_mean(soft_cross_entropy(pred, tgt), m))
        with torch.no_grad():
            tops.append(float(masked_mean((pred.argmax(-1) == tgt.argmax(-1)).float(), m)))
    loss = torch.stack(losses).mean()
    return loss, {"ce": float(loss.detach()), **{f"top1_head{k}": t for k, t in enumerate(tops)}}
