"""nemo_tlt.optim: the one AdamW + LR schedule builder."""
import pytest
import torch

from nemo_tlt.optim import OptimConfig, build_optimizer, warmup_cosine_lr


class _Scoped(OptimConfig):
    KEY = "drafter.optim"


def test_schedule_is_exactly_warmup_cosine_and_constant_by_default():
    cfg = OptimConfig(lr=1e-3, warmup_steps=3, decay_steps=10, min_lr_ratio=0.1)
    assert [cfg.lr_at(s) for s in range(20)] == [warmup_cosine_lr(s, 1e-3, 3, 10, 0.1) for s in range(20)]
    flat = OptimConfig(lr=3e-5)
    assert {flat.lr_at(s) for s in range(5)} == {3e-5}
    assert [OptimConfig(lr=2.0, warmup_steps=4).lr_at(s) for s in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]


def test_build_optimizer_applies_config_and_schedule_to_every_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    cfg = OptimConfig(lr=1.0, weight_decay=0.1, betas=[0.8, 0.9], warmup_steps=2)
    opt, schedule = build_optimizer([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], cfg, foreach=False)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["foreach"] is False for g in opt.param_groups)
    assert schedule.apply(0) == 0.5 and [g["lr"] for g in opt.param_groups] == [0.5, 0.5]


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": 0.0}, "drafter.optim.lr must be > 0, got 0.0"),
    ({"betas": [0.9]}, "drafter.optim.betas must be two numbers"),
    ({"betas": [0.9, 1.0]}, r"drafter.optim.betas\[1\] must be < 1"),
    ({"warmup_steps": -1}, "drafter.optim.warmup_steps must be >= 0"),
    ({"min_lr_ratio": 0.1}, "drafter.optim.min_lr_ratio=0.1 needs drafter.optim.decay_steps"),
])
def test_errors_name_the_yaml_key_of_the_subclass(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _Scoped(**kwargs)
