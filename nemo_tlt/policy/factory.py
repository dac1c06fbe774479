"""``build_policy_backend``: the one place that picks a ``PolicyBackend`` implementation, the
factory ``policy.backend`` names in the backend registry (``policy.config.BACKENDS``: the
built-in ones below, any registered one, or an import path).

The process group, if any, is initialised by the launcher before this is called (every
rank calls it); a single torch rank needs none. The megatron backend imports
megatron-core lazily and fails with the install step when it is missing.
"""
from __future__ import annotations

from typing import Mapping

import torch

from nemo_tlt.algorithms.protocol import RLAlgorithm
from nemo_tlt.device import Placement
from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.config import BACKENDS, PolicyConfig
from nemo_tlt.policy.protocol import PolicyBackend
from nemo_tlt.weights.sources import CanonicalSource, check_source, expected_shapes, read_whole


def build_policy_backend(config: PolicyConfig, canonical: Mapping[str, torch.Tensor] | CanonicalSource,
                         model_config: LMConfig, *, temperature: float, seed: int,
                         placement: Placement = Placement(), algorithm: RLAlgorithm | None = None
                         ) -> PolicyBackend:
    """The backend ``config.backend`` names, holding a copy of ``canonical`` (a state dict, or a
    ``CanonicalSource`` such as ``SafetensorsFolder``: the megatron backend then reads only its
    rank's slices; the torch backend, a whole replica, reads everything); ``temperature`` is the
    sampling temperature the log-probs are taken at; ``seed`` seeds megatron's RNG tracker;
    ``placement`` is the rank's device and the weights dtype (fp32 master weights either way);
    ``algorithm`` the RL algorithm whose ``policy_loss`` the update minimises (None: GRPO). A
    factory is called with ``algorithm=`` only when one is given; the RL loop always gives the
    run's, so a backend factory takes it (docs/extending.md)."""
    factory = BACKENDS.get(config.backend)
    extra = {} if algorithm is None else {"algorithm": algorithm}
    return factory(config, canonical, model_config, temperature=temperature, seed=seed, placement=placement,
                   **extra)


def torch_backend(config: PolicyConfig, canonical: Mapping[str, torch.Tensor] | CanonicalSource,
                  model_config: LMConfig, *, temperature: float, seed: int,
                  placement: Placement = Placement(), algorithm: RLAlgorithm | None = None) -> PolicyBackend:
    """The torch backend: a whole replica per rank (reads every tensor of a source)."""
    from nemo_tlt.policy.torch_backend import TorchPolicy, build_decoder

    if isinstance(canonical, CanonicalSource):
        check_source(canonical, model_config)
        canonical = read_whole(canonical, expected_shapes(model_config), placement.dtype)
    return TorchPolicy(build_decoder(canonical, model_config, placement), config, temperature=temperature,
                       algorithm=algorithm)


def megatron_backend(config: PolicyConfig, canonical: Mapping[str, torch.Tensor] | CanonicalSource,
                     model_config: LMConfig, *, temperature: float, seed: int,
                     placement: Placement = Placement(), algorithm: RLAlgorithm | None = None) -> PolicyBackend:
    """The megatron-core backend (imports megatron-core now; reads only its rank's slices of a source)."""
    from nemo_tlt.policy.megatron_backend import MegatronPolicy

    return MegatronPolicy(canonical, model_config, config, temperature=temperature, seed=seed,
                          placement=placement, algorithm=algorithm)
