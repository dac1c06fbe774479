"""``SafetensorsFolder``: an HF model folder's weights as a lazily read ``CanonicalSource``.

Defined in ``nemo_tlt.model.safetensors_folder`` (the rollout engine, below this layer,
reads its tensor-parallel slices with it); re-exported here, where the weight converters
look for their sources.
"""
from __future__ import annotations

from nemo_tlt.model.safetensors_folder import INDEX, SafetensorsFolder

__all__ = ["INDEX", "SafetensorsFolder"]
