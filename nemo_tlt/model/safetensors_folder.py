"""``SafetensorsFolder``: an HF model folder's weights, read lazily, a slice at a time.

It is a ``CanonicalSource`` (nemo_tlt.weights.sources). It lives in the model layer so
that the rollout engine can read its own tensor-parallel slices (nemo_tlt.model.tp_layout)
without importing the weights layer above it; ``nemo_tlt.weights.hf_source`` re-exports it.

Contract: ``SafetensorsFolder(path)`` reads only the safetensors headers (one file, or
the files of ``model.safetensors.index.json``); ``read`` opens the file holding the
tensor, copies the requested rows / columns out of safetensors' memory map (only the
pages under them are touched) and closes the file again, so that nothing of the file
stays mapped between reads. A folder with weights in another format (``*.bin``,
``*.pt``, ``*.pth``: pickles, which cannot be sliced without loading them whole) and no
safetensors is refused with a ValueError that says how to convert it; a folder with no
weights at all raises FileNotFoundError. ``check_source(source, cfg)`` (any
``CanonicalSource``; re-exported by ``nemo_tlt.weights.sources``) refuses a source whose
tensors do not match ``cfg``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import canonical_shapes

INDEX = "model.safetensors.index.json"
_OTHER_FORMATS = ("*.bin", "*.pt", "*.pth")


def check_range(shape: tuple[int, ...], dim: int, start: int, stop: int, what: str) -> None:
    """Raise a ValueError unless ``start:stop`` of dim 0 or 1 lies inside ``shape``."""
    if dim not in (0, 1) or dim >= len(shape):
        raise ValueError(f"{what}: cannot slice dim {dim} of a {len(shape)}-d tensor")
    if not 0 <= start <= stop <= shape[dim]:
        raise ValueError(f"{what}: slice {start}:{stop} of dim {dim} is outside its {shape[dim]} entries")


def copy_out(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor in ``dtype`` holding ``view``'s values (one copy, one cast)."""
    out = torch.empty(view.shape, dtype=dtype)
    out.copy_(view)
    return out


def check_source(source, cfg: LMConfig) -> None:
    """Raise a ValueError naming the source (a ``CanonicalSource``: ``label``, ``names()``,
    ``shape(name)``) when it does not hold exactly ``cfg``'s tensors; with tied embeddings a
    stored ``lm_head.weight`` is ignored."""
    where = source.label
    expected = canonical_shapes(cfg)
    have = set(source.names())
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")
    missing, unexpected = sorted(set(expected) - have), sorted(have - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if source.shape(name) != shape:
            raise ValueError(f"{where}: {name} has shape {source.shape(name)}, config.json implies {shape}")


def _weight_files(folder: Path) -> list[str]:
    index = folder / INDEX
    if index.is_file():
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if files:
        return files
    others = sorted(p.name for pattern in _OTHER_FORMATS for p in folder.glob(pattern))
    if others:
        raise ValueError(f"{folder}: weights are stored as {others[:3]}, not safetensors; the per-rank loader "
                         "reads slices of safetensors files only (pickled checkpoints load whole). Convert the "
                         "folder once, e.g. transformers' from_pretrained(...).save_pretrained(dir, "
                         "safe_serialization=True)")
    raise FileNotFoundError(f"{folder}: no *.safetensors weights found")


class SafetensorsFolder:
    """A ``CanonicalSource`` over the safetensors files of an HF folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.folder = Path(path)
        self.label = str(self.folder)
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for name in _weight_files(self.folder):
            file = self.folder / name
            if not file.is_file():
                raise FileNotFoundError(f"{self.folder}: {INDEX} names {name}, which is missing")
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in self._file:
                        raise ValueError(f"{self.folder}: tensor {key} is stored twice ({self._file[key].name}, "
                                         f"{name})")
                    self._file[key] = file
                    self._shape[key] = tuple(f.get_slice(key).get_shape())
        self.bytes_read = 0

    def names(self) -> frozenset[str]:
        return frozenset(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def read(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        with safe_open(str(self._file[name]), framework="pt") as f:
            part = f.get_slice(name)
            check_range(self._shape[name], dim, start, stop, f"{self.folder}: {name}")
            view = part[start:stop] if dim == 0 else part[:, start:stop]
            self.bytes_read += view.numel() * view.element_size()
            out = copy_out(view, dtype)
            del view  # the memory map goes when the file closes and no view is left on it
        return out
