"""The fused inference projections (qkv, gate/up) agree with the separate layers
used in training, and follow in-place weight updates."""
from __future__ import annotations

import torch

from nemo_tlt.model.lm import DecoderLM
from tiny import tiny_config


def test_fused_matches_separate_and_tracks_updates():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(family="qwen2"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    ids = torch.randint(0, 32, (2, 9))
    for _ in range(2):
        with torch.enable_grad():
            reference = model(ids).detach()     # separate q/k/v and gate/up layers
        with torch.no_grad():
            fused = model(ids)                  # fused weights
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
        with torch.no_grad():                   # an in-place update must invalidate the fused copy
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        assert not torch.allclose(model(ids), reference, atol=1e-3)
