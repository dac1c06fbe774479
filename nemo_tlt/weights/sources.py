"""Canonical weight sources: read a slice of one canonical (HF-named) tensor without the rest.

Contract: a ``CanonicalSource`` names its tensors (``names()``), gives their shapes
(``shape(name)``) and reads ``read(name, dim, start, stop, dtype)``: rows (``dim=0``) or
columns (``dim=1``) ``start:stop`` of one tensor as a new, contiguous tensor in ``dtype``
that shares no memory with the source (the caller may keep or modify it). Casting goes
straight from the stored dtype to ``dtype``. ``bytes_read`` counts the stored bytes of
every slice read so far, so a caller (a test, the load benchmark) can check what was read.

``MappingSource`` wraps an in-memory canonical state dict; the lazily read HF folder is
``nemo_tlt.weights.hf_source.SafetensorsFolder`` (defined, with ``check_range`` and
``copy_out``, in ``nemo_tlt.model.safetensors_folder``). ``check_source(source, cfg)`` refuses
a source whose tensors do not match ``cfg`` (missing, unexpected, wrong shape), as
``nemo_tlt.model.hf_io.load_hf_folder`` does; with tied embeddings a stored
``lm_head.weight`` is ignored, as there.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol, runtime_checkable

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.safetensors_folder import check_range, check_source, copy_out

__all__ = ["CanonicalSource", "MappingSource", "check_range", "copy_out", "expected_shapes", "read_whole",
           "check_source"]

Tensor = torch.Tensor


@runtime_checkable
class CanonicalSource(Protocol):
    label: str  # where the weights come from, for error messages
    bytes_read: int

    def names(self) -> frozenset[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> Tensor: ...


class MappingSource:
    """A ``CanonicalSource`` over an in-memory canonical state dict (no copy of it is made)."""

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self._state = state
        self.label = "canonical state dict"
        self.bytes_read = 0

    def names(self) -> frozenset[str]:
        return frozenset(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def read(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        tensor = self._state[name].detach()
        check_range(tuple(tensor.shape), dim, start, stop, name)
        view = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
        self.bytes_read += view.numel() * view.element_size()
        return copy_out(view, dtype)


def expected_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of ``cfg``'s model and its shape (``nemo_tlt.model.lm.canonical_shapes``)."""
    from nemo_tlt.model.lm import canonical_shapes

    return canonical_shapes(cfg)


def read_whole(source: CanonicalSource, names: Iterable[str], dtype: torch.dtype) -> dict[str, Tensor]:
    """The named tensors, whole, in ``dtype``."""
    return {name: source.read(name, 0, 0, source.shape(name)[0], dtype) for name in names}
