"""Config field checks: the message names the field and what was expected."""
from __future__ import annotations

import pytest

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.drafter.train import DrafterTrainConfig
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.demo.sft import SFTConfig
from nemo_tlt.spot.harvest import HarvestConfig
from nemo_tlt.spot.trainer import DrafterOptimConfig, SpotTrainerConfig
from nemo_tlt.weights.layout import ParallelLayout


@pytest.mark.parametrize("value, lo, hi, match", [
    (True, None, None, "an int, got True"), (1.0, None, None, "an int"), ("3", 1, None, "an int"),
    (0, 1, None, ">= 1, got 0"), (5, 0, 4, r"in \[0, 4\], got 5"), (9, None, 8, "<= 8, got 9"),
])
def test_check_int_refuses(value, lo, hi, match):
    with pytest.raises(ValueError, match=f"A.b must be {match}"):
        check_int("A.b", value, lo, hi)


@pytest.mark.parametrize("value, kwargs, match", [
    (False, {}, "a number"), ("0.1", {}, "a number"), (float("nan"), dict(lo=0), "a number"),
    (0.0, dict(lo=0, lo_open=True), "> 0"),
    (-1e-9, dict(lo=0), ">= 0"), (1.0, dict(hi=1, hi_open=True), "< 1"), (1.5, dict(hi=1), "<= 1"),
])
def test_check_float_refuses(value, kwargs, match):
    with pytest.raises(ValueError, match=f"A.b must be {match}"):
        check_float("A.b", value, **kwargs)


def test_bounds_that_hold_pass():
    check_int("A.b", 3, 1, 3)
    check_float("A.b", 0.5, 0, 1, lo_open=True, hi_open=True)
    check_float("A.b", 2, 0)  # an int is a number


@pytest.mark.parametrize("make, match", [
    (lambda: DrafterTrainConfig(steps="3"), r"DrafterTrainConfig\.steps must be an int"),
    (lambda: DrafterTrainConfig(feature_noise=-0.1), r"DrafterTrainConfig\.feature_noise must be >= 0"),
    (lambda: SFTConfig(adam_beta2=1.0), r"SFTConfig\.adam_beta2 must be < 1"),
    (lambda: SFTConfig(warmup_steps=400, steps=300), r"SFTConfig\.warmup_steps must be in \[0, 300\]"),
    (lambda: PolicyConfig(clip_eps=1.0), r"policy\.clip_eps must be < 1"),
    (lambda: PolicyConfig(micro_batch=0), r"policy\.micro_batch must be >= 1"),
    (lambda: SpotTrainerConfig(batch_size=True), r"SpotTrainerConfig\.batch_size must be an int"),
    (lambda: SpotTrainerConfig(optim=DrafterOptimConfig(betas=[0.9, 1.0])), r"drafter\.trainer\.optim\.betas\[1\] must be < 1"),
    (lambda: HarvestConfig(hidden_size=8, recency_decay=0.0), r"HarvestConfig\.recency_decay must be > 0"),
    (lambda: HarvestConfig(hidden_size=8, min_length=1), r"HarvestConfig\.min_length must be >= 2"),
    (lambda: ParallelLayout(tp=0), r"ParallelLayout\.tp must be >= 1"),
    (lambda: PolicyConfig(backend="megatron", pipeline_parallel="2"), r"policy\.pipeline_parallel must be an int"),
])
def test_configs_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()
