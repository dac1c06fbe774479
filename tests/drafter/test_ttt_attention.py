"""TTT attention: one score per diagonal block equals attention over the concatenated keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_tlt.drafter.ttt import ttt_attention


def dense_reference(q, keys, values, causal):
    """The concatenated form: step-0 keys under `causal`, then one diagonal block per later step."""
    B, _, T, _ = q.shape
    diag = torch.eye(T, dtype=torch.bool).expand(B, T, T)
    mask = torch.cat([causal] + [diag] * (len(keys) - 1), -1)[:, None]
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys[0].shape[1])


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("nkv", [4, 2])
def test_equals_attention_over_concatenated_keys(steps, nkv):
    g = torch.Generator().manual_seed(steps * 10 + nkv)
    B, nh, T, d = 3, 4, 7, 8
    q = torch.randn(B, nh, T, d, generator=g, requires_grad=True)
    keys = [torch.randn(B, nkv, T, d, generator=g, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, d, generator=g, requires_grad=True) for _ in range(steps)]
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).clone()
    causal[1, 4:, :4] = False  # a packed row: a second sample starts at slot 4
    causal[2, 5:] = False      # padding rows see no prefix at all, only their own later steps
    got, want = ttt_attention(q, keys, values, causal), dense_reference(q, keys, values, causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), [q, *keys, *values])
    ref = torch.autograd.grad(want.square().sum(), [q, *keys, *values])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
