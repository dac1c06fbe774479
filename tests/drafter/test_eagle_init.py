"""EAGLE drafter initialisation is reproducible from an explicit generator."""
from __future__ import annotations

import torch

from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from tiny import tiny_config


def test_generator_seeds_the_initial_weights():
    cfg = EagleConfig.from_target(tiny_config())
    a = EagleDrafter(cfg, generator=torch.Generator().manual_seed(3)).state_dict()
    torch.manual_seed(123)   # the global RNG does not matter
    b = EagleDrafter(cfg, generator=torch.Generator().manual_seed(3)).state_dict()
    c = EagleDrafter(cfg, generator=torch.Generator().manual_seed(4)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert float(a["fc.bias"].abs().sum()) == 0.0
