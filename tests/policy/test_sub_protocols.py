"""The optional parts of the policy contract (``nemo_tlt.policy.protocol``) as the backends
declare them: the torch backend implements the pipelined update's accumulation, the
megatron backend sharded checkpoints, both the training-state offload; the loop refuses a setting whose part a backend lacks,
naming it (checked here on a backend without either)."""
from __future__ import annotations

import pytest

from nemo_tlt.drafter.base import CapturesLayers
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.policy.protocol import (OffloadsTrainingState, PipelinedAccumulation, ShardedCheckpoints,
                                      missing_methods, require)
from nemo_tlt.policy.torch_backend import TorchPolicy
from tiny import tiny_config


def test_the_backends_declare_their_optional_parts():
    from nemo_tlt.policy.megatron_backend import MegatronPolicy

    assert missing_methods(TorchPolicy, PipelinedAccumulation) == []
    assert missing_methods(MegatronPolicy, ShardedCheckpoints) == []
    assert missing_methods(TorchPolicy, OffloadsTrainingState) == missing_methods(MegatronPolicy,
                                                                                  OffloadsTrainingState) == []
    assert missing_methods(MegatronPolicy, PipelinedAccumulation) == [
        "begin_accumulation", "num_parts", "accumulate", "apply_accumulated"]


def test_a_setting_whose_part_is_missing_is_refused_by_name():
    class Plain:  # a backend with the core contract only
        pass

    with pytest.raises(ValueError, match=r"policy.pipelined_update=true: the mine policy backend does not implement "
                                         r"PipelinedAccumulation .*missing \['begin_accumulation'"):
        require(Plain(), PipelinedAccumulation, "mine", "policy.pipelined_update=true")
    with pytest.raises(ValueError, match="ShardedCheckpoints"):
        require(Plain(), ShardedCheckpoints, "mine", "a sharded policy state")


def test_drafters_that_read_target_layers_say_so():
    cfg = tiny_config(num_layers=3)
    assert isinstance(Eagle3Drafter(Eagle3Config.from_target(cfg)), CapturesLayers)
    assert not isinstance(EagleDrafter(EagleConfig.from_target(cfg)), CapturesLayers)
