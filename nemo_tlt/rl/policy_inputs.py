"""What a rank needs from the target folder to build its policy and the drafter's target view,
without loading the whole model into the loop.

Contract: ``load_policy_inputs(target_dir)`` reads ``config.json`` and the safetensors
headers only (``SafetensorsFolder``; a folder of pickled ``*.bin`` weights is refused
with how to convert it). ``inputs.weights`` goes to ``build_policy_backend`` in place of a
canonical state dict: the megatron backend then reads only its rank's slices, once, in
the weights dtype; the torch backend (a whole replica) reads every tensor once.
``inputs.target_view(placement)`` is the drafter's ``TargetView`` filled with the only
tensors it holds (embedding, final norm, LM head), read in ``placement``'s dtype. The
rollout engine keeps loading the folder itself (``build_rollout_engine``): its layout is
its own. Nothing here keeps a tensor: the loop holds no copy of the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from nemo_tlt.device import Placement
from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.weights.hf_source import SafetensorsFolder
from nemo_tlt.weights.sources import check_source, read_whole


@dataclass(frozen=True)
class PolicyInputs:
    model_config: LMConfig
    weights: SafetensorsFolder

    def target_view(self, placement: Placement = Placement()) -> TargetView:
        """The drafter's view of the target, read from the folder (its tensors only)."""
        view = TargetView(self.model_config, placement=placement)
        return view.load(read_whole(self.weights, sorted(view.names), placement.dtype))


def load_policy_inputs(target_dir: str | os.PathLike) -> PolicyInputs:
    """The target folder's config and its lazily read weights, checked against each other."""
    model_config = read_config(target_dir)
    weights = SafetensorsFolder(target_dir)
    check_source(weights, model_config)
    return PolicyInputs(model_config, weights)
