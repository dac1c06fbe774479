"""The weight-sync stream: the policy's canonical weights, tensor by tensor, to the
rollout engine, with what else the step needs from the same pass.

``WeightStream(source, keep=..., view=...)`` is iterated once by the engine's
``load_policy_weights``; as each (name, tensor) goes by it is hashed (data-parallel
replicas must end every step with the same bits), copied into the drafter's view of
the target when there is one, and kept by reference when ``keep`` (rank 0 checkpoints
the weights the engine serves). The stream itself copies nothing.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

import torch

from nemo_tlt.drafter.target_view import TargetView


class WeightStream:
    def __init__(self, source: Iterable[tuple[str, torch.Tensor]], keep: bool = False,
                 view: TargetView | None = None) -> None:
        self.source, self.keep, self.view = source, keep, view
        self.kept: dict[str, torch.Tensor] = {}
        self._hash = hashlib.sha256()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            self._hash.update(_bytes(tensor))
            if self.view is not None:
                self.view.update(name, tensor)
            if self.keep:
                self.kept[name] = tensor
            yield name, tensor

    def add(self, module: torch.nn.Module) -> None:
        """Hash another module's weights into the digest (e.g. the drafter's)."""
        for t in module.state_dict().values():
            self._hash.update(_bytes(t))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def _bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, for any dtype (numpy has no bfloat16)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
