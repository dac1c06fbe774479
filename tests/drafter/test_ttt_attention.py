"""TTT attention: one score per diagonal block equals attention over the concatenated keys."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.drafter.ttt import ttt_attention, ttt_attention_reference


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
    got, want = ttt_attention(q, keys, values, causal), ttt_attention_reference(q, keys, values, causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), [q, *keys, *values])
    ref = torch.autograd.grad(want.square().sum(), [q, *keys, *values])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_as_close_to_float32_as_the_reference():
    """Computed in float32: in bfloat16 the result stays as close to the float32
    result as the plain (fused) form's."""
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, T, d, steps = 2, 4, 2, 33, 16, 4
    q = torch.randn(B, nh, T, d, generator=g)
    keys = [torch.randn(B, nkv, T, d, generator=g) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, d, generator=g) for _ in range(steps)]
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    exact = ttt_attention_reference(q, keys, values, causal)
    bf = [q.bfloat16(), [k.bfloat16() for k in keys], [v.bfloat16() for v in values], causal]
    got = ttt_attention(*bf)
    err = (got.float() - exact).abs().max()
    ref_err = (ttt_attention_reference(*bf).float() - exact).abs().max()
    assert got.dtype == torch.bfloat16
    assert err <= 1.5 * ref_err, (float(err), float(ref_err))
