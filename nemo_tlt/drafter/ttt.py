"""EAGLE-3 training-time test (TTT): the drafter's own outputs fed back for later steps.

From a batch of chains (`EagleBatch`: row positions t with the token x[t+1] and the
target's captured features g[t]), step 0 is the ordinary forward: the input at t is
(x[t+1], fc(g[t])), its output o0[t] predicts x[t+2]. Step j >= 1 feeds, at the same
chain t, the token x[t+j+1] and the previous step's output o_{j-1}[t] (not a target
feature: what the drafter sees at tree depth j) at rope position t + j, and predicts
x[t+j+2]. Attention mirrors drafting exactly: a query of step j at chain t sees the
step-0 keys of positions <= t in its own sample (the committed prefix, through the
batch's mask) and the keys of steps 1..j of its own chain t (its tree ancestors and
itself): a causal block followed by j diagonal blocks.

Loss: cross-entropy of the draft distribution (over the draft vocabulary) against
the target's own distribution there, as EAGLE-3 trains: the soft label of step j at
chain t is ``softmax(lm_head(final[t + j + 1]))`` restricted to the draft vocabulary,
from the final hidden state the features carry after the captured layers (see
nemo_tlt.drafter.eagle3). ``sum_j decay^j * mean CE_j`` over positions whose label
exists in the same sample and whose target argmax lies in the draft vocabulary
(EAGLE-3 masks the others too). A sampled token would be a one-sample estimate of
that distribution: under sampled rollouts the full distribution is the teacher
acceptance depends on.

Labels are read from the batch: the label of step j at chain t comes from
``target_feat[t + j]`` (the final state at t + j + 1), valid when slot t + j holds
position t + j of the same sample (positions restart at 0 for every packed sample,
so this also holds for packed rows). Step j is scored on the chains t < T - j by
slicing, not on padded copies; the target's logits are taken over the draft
vocabulary only, and its full-vocabulary argmax (for the mask) in row chunks, so no
[B, T, vocab] tensor is kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_tlt.drafter.data import EagleBatch
from nemo_tlt.drafter.draft_vocab import draft_ids
from nemo_tlt.drafter.eagle3 import Eagle3Drafter
from nemo_tlt.drafter.features import split_features
from nemo_tlt.drafter.loss import masked_mean
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.rope import apply_rope


def shift_left(x: torch.Tensor, j: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t + j] at t (dim 1), `fill` past the end."""
    if j == 0:
        return x
    pad = x.new_full((x.shape[0], j, *x.shape[2:]), fill)
    return torch.cat((x[:, j:], pad), 1)[:, : x.shape[1]]


def ttt_attention_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                            causal: torch.Tensor) -> torch.Tensor:
    """The plain form of `ttt_attention`: scaled-dot-product attention over the
    concatenated keys of steps 0..j with the mask [causal | diag | ... | diag]."""
    B, _, T, _ = q.shape
    diag = torch.eye(T, dtype=torch.bool, device=q.device).expand(B, T, T)
    mask = torch.cat([causal] + [diag] * (len(keys) - 1), -1)[:, None]                # [B, 1, T, (j+1)T]
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys[0].shape[1])


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  causal: torch.Tensor) -> torch.Tensor:
    """Attention of step j = len(keys) - 1 (see the module docstring): queries
    q [B, nh, T, d] see the step-0 keys ``keys[0]`` [B, nkv, T, d] where ``causal``
    [B, T, T] allows, and the keys of steps 1..j at their own position only. Equals
    `ttt_attention_reference`, but the j diagonal blocks are one score per position
    (as EAGLE-3's reference code computes them): O(T^2 + jT) per step, not
    O((j+1) T^2). Computed in float32 (as fused attention accumulates), returned in q's dtype."""
    if len(keys) == 1:  # step 0: the causal block alone (no diagonal blocks to build)
        return F.scaled_dot_product_attention(q, keys[0], values[0], attn_mask=causal[:, None],
                                              enable_gqa=q.shape[1] != keys[0].shape[1])
    B, nh, T, d = q.shape
    nkv = keys[0].shape[1]
    # GQA: query head h reads kv head h // (nh // nkv), as SDPA's enable_gqa
    qg = q.float().view(B, nkv, nh // nkv, T, d)

    def kv(x: torch.Tensor) -> torch.Tensor:  # [B, nkv, T, d] -> [B, nkv, 1, T, d], broadcast over the group
        return x.float()[:, :, None]

    scale = d ** -0.5
    prefix = (qg @ kv(keys[0]).transpose(-1, -2)).mul_(scale).masked_fill_(~causal[:, None, None], float("-inf"))
    own = torch.stack([(qg * kv(k)).sum(-1) for k in keys[1:]], -1).mul_(scale)       # [B, nkv, g, T, j]
    p = torch.cat((prefix, own), -1).softmax(-1)
    later = torch.stack([kv(v) for v in values[1:]], -2)                               # [B, nkv, 1, T, j, d]
    out = p[..., :T] @ kv(values[0]) + (p[..., T:, None] * later).sum(-2)
    return out.view(B, nh, T, d).to(q.dtype)


def ttt_outputs(drafter: Eagle3Drafter, target: DecoderLM, batch: EagleBatch, features: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """The outputs o_j [B, T, H] of steps j = 0..steps-1 (see module docstring);
    `features` are the batch's target features g [B, T, k*H] (noised or not)."""
    B, T = batch.next_tokens.shape
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    h_dev = batch.next_tokens.device
    causal = batch.new_mask if batch.new_mask is not None else torch.ones(T, T, dtype=torch.bool,
                                                                                    device=h_dev).tril().expand(B, T, T)
    h = drafter.fuse(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    for j in range(steps):
        tokens = shift_left(batch.next_tokens, j)
        emb = target.model.embed_tokens(tokens).detach().to(h.dtype)
        a, resid = layer.attn_input(torch.cat((emb, h), -1))
        q = attn.q_proj(a).view(B, T, nh, d).transpose(1, 2)
        k = attn.k_proj(a).view(B, T, nkv, d).transpose(1, 2)
        v = attn.v_proj(a).view(B, T, nkv, d).transpose(1, 2)
        cos, sin = target.rope(batch.positions + j)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k)
        values.append(v)
        o = ttt_attention(q, keys, values, causal)
        h = layer.finish(resid, attn.o_proj(o.transpose(1, 2).reshape(B, T, nh * d)))
        outs.append(h)
    return outs


def eagle3_loss(drafter: Eagle3Drafter, target: DecoderLM, batch: EagleBatch,
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TTT loss over `drafter.config.ttt_steps` steps; `features` default to batch.in_feat.
    The batch's features must have the drafter's `feature_width` (captured layers, then
    the final state)."""
    cfg = drafter.config
    feats = batch.in_feat if features is None else features
    if batch.target_feat.shape[-1] != drafter.feature_width:
        raise ValueError(f"eagle3_loss: features are {batch.target_feat.shape[-1]} wide, the EAGLE-3 drafter "
                         f"needs {drafter.feature_width} ({len(cfg.capture_layers)} captured layers and the final "
                         "hidden state, each hidden_size wide)")
    outs = ttt_outputs(drafter, target, batch, feats, cfg.ttt_steps)
    with torch.no_grad():  # the target's distribution of x[t+2], from its final state at t+1
        weight = target.lm_head_weight.detach()
        final = split_features(batch.target_feat, len(cfg.capture_layers))[1].to(weight.dtype)
        if drafter.full_vocab:
            teacher = F.linear(final, weight).float()
            kept = torch.ones(teacher.shape[:-1], dtype=torch.bool, device=teacher.device)
        else:  # EAGLE-3 masks positions whose target argmax lies outside the draft vocabulary
            kept = drafter.t2d[argmax_logits(final, weight)]
            teacher = F.linear(final, weight[draft_ids(drafter.d2t)]).float()
        teacher_p = teacher.softmax(-1)
        teacher_top = teacher.argmax(-1)
    T = batch.mask.shape[1]
    total = feats.new_zeros((), dtype=drafter.fc.weight.dtype)
    stats: dict[str, float] = {}
    for j, out in enumerate(outs):
        n = T - j  # chains t < n have slot t + j
        valid = (batch.mask[:, :n] & batch.mask[:, j:] & (batch.positions[:, j:] == batch.positions[:, :n] + j)
                 & kept[:, j:])
        logits = drafter.head(out[:, :n]).float()
        ce = -(teacher_p[:, j:] * logits.log_softmax(-1)).sum(-1)
        ce_mean = masked_mean(ce, valid)
        total = total + cfg.ttt_decay ** j * ce_mean
        with torch.no_grad():
            stats[f"ce_step{j}"] = float(ce_mean)
            stats[f"top1_step{j}"] = float(masked_mean((logits.argmax(-1) == teacher_top[:, j:]).float(), valid))
    stats["ce"] = stats["ce_step0"]
    stats["top1"] = stats["top1_step0"]
    return total, stats


def argmax_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """argmax of ``hidden @ weight.T`` over the last dim, [...], computed ``rows`` rows at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.cat([F.linear(flat[i: i + rows], weight).argmax(-1) for i in range(0, flat.shape[0], rows)]
                    ) if flat.shape[0] else torch.zeros(0, dtype=torch.long, device=hidden.device)
    return out.view(hidden.shape[:-1])
