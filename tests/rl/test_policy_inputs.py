"""load_policy_inputs: the policy's weights as a lazy source and the drafter's view, without the
whole model in the loop; both equal what loading the folder whole gives."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.device import Placement
from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.policy import PolicyConfig, build_policy_backend
from nemo_tlt.rl.policy_inputs import load_policy_inputs
from tiny import tiny_target


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def folder(request, tmp_path):
    return save_hf_folder(tiny_target(seed=3, tie_word_embeddings=request.param), tmp_path / "target")


def test_target_view_reads_only_its_tensors_and_equals_the_whole_load(folder):
    inputs = load_policy_inputs(folder)
    placement = Placement(dtype=torch.bfloat16)
    view = inputs.target_view(placement)
    want = TargetView(inputs.model_config, placement=placement).load(load_hf_folder(folder).state_dict())
    assert set(view.state_dict()) == set(want.state_dict())
    for name, tensor in want.state_dict().items():
        assert torch.equal(view.state_dict()[name], tensor), name
    view_bytes = sum(4 * v.numel() for v in view.state_dict().values())  # the folder is fp32
    assert inputs.weights.bytes_read == view_bytes


def test_torch_policy_from_the_source_equals_the_one_from_the_state_dict(folder):
    inputs = load_policy_inputs(folder)
    config = PolicyConfig(backend="torch")
    lazy = build_policy_backend(config, inputs.weights, inputs.model_config, temperature=1.0, seed=0)
    whole = build_policy_backend(config, load_hf_folder(folder).state_dict(), inputs.model_config,
                                 temperature=1.0, seed=0)
    got, want = lazy.model.state_dict(), whole.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
