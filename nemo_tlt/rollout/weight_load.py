"""Policy weights into the embedded engine: the checks of one streamed ``(name, tensor)``
item, the engine's compute copy of its target (``rollout.compute_dtype``), and, for a
tensor-parallel engine, reading this rank's slices of an HF folder.

Tensor parallelism (nemo_tlt.model.tp_layout): a TP rank's parameters are its slices of
the canonical tensors, under the canonical names. A streamed tensor is accepted whole
(the rank keeps its slice: ``rollout_slice``, a view, copied into the parameter) or
already sliced (its shape is the local one), so the torch policy's full canonical
weights and the megatron policy's rollout slices both load.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.model.lm import DecoderLM, canonical_shapes
from nemo_tlt.model.rope import rope_tables_for
from nemo_tlt.model.safetensors_folder import SafetensorsFolder, check_source
from nemo_tlt.model.tensor_parallel import TensorParallel, active
from nemo_tlt.model.tp_layout import rollout_range, rollout_slice, rollout_split_dim


def compute_copy(target: DecoderLM, dtype: torch.dtype | None) -> DecoderLM:
    """`target`, or a copy of it computing in `dtype` (its weights' values kept: a bf16
    weight is exact in fp32). The rotary tables are recomputed in fp32, as the model
    builds them, rather than carried over from a lower precision. A TP copy shares the
    target's process group."""
    if dtype is None or dtype == target.lm_head_weight.dtype:
        return target
    out = copy.deepcopy(target).to(dtype)
    cos, sin = rope_tables_for(target.config)
    device = target.lm_head_weight.device
    out.rope_cos, out.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
    return out


def weight_pair(i: int, item: Any) -> tuple[str, torch.Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
        raise ValueError(f"load_policy_weights: item {i} of the stream must be a (name, tensor) pair, "
                         f"got {type(item).__name__}")
    if not isinstance(item[1], torch.Tensor):
        raise ValueError(f"load_policy_weights: tensor {item[0]!r} must be a torch.Tensor, "
                         f"got {type(item[1]).__name__}")
    return item


def check_weight(name: str, tensor: torch.Tensor, params: Mapping[str, torch.Tensor], seen: set[str]) -> None:
    if name not in params:
        hint = " (the model ties lm_head to model.embed_tokens)" if name == "lm_head.weight" else ""
        raise ValueError(f"load_policy_weights: unknown tensor {name!r}: not a canonical name of this "
                         f"model{hint}")
    if name in seen:
        raise ValueError(f"load_policy_weights: tensor {name!r} was given twice")
    if tuple(tensor.shape) != tuple(params[name].shape):
        raise ValueError(f"load_policy_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(params[name].shape)}")


def local_part(name: str, tensor: torch.Tensor, local: tuple[int, ...], full: tuple[int, ...],
               tp: TensorParallel) -> torch.Tensor:
    """This TP rank's part of streamed tensor ``name``: ``tensor`` itself when it has the
    local shape, its ``rollout_slice`` (a view) when it has the whole model's."""
    shape = tuple(tensor.shape)
    if shape == local:
        return tensor
    if shape == full:
        return rollout_slice(name, tensor, tp.size, tp.rank)
    raise ValueError(f"load_policy_weights: tensor {name!r} has shape {shape}; TP rank {tp.rank} of {tp.size} "
                     f"takes the whole tensor {full} or its own slice {local}")


def load_tp_folder(path: str | os.PathLike, tp: TensorParallel, device: torch.device | str,
                   dtype: torch.dtype) -> DecoderLM:
    """This TP rank's ``DecoderLM`` of the HF folder at ``path``: each of its tensors is
    read once, only this rank's slice, in ``dtype`` (nemo_tlt.model.safetensors_folder),
    and copied onto ``device``; no rank holds the whole model."""
    return load_tp_source(SafetensorsFolder(path), read_config(path), tp, device, dtype)


@torch.no_grad()
def load_tp_source(source: SafetensorsFolder, config: LMConfig, tp: TensorParallel, device: torch.device | str,
                   dtype: torch.dtype) -> DecoderLM:
    """`load_tp_folder` from a source with ``names()``, ``shape(name)`` and
    ``read(name, dim, start, stop, dtype)`` (a ``CanonicalSource``)."""
    if active(tp) is None:
        raise ValueError(f"load_tp_source: tensor parallel size {tp.size}: a size-1 model loads whole "
                         "(nemo_tlt.model.hf_io.load_hf_folder)")
    check_source(source, config)
    full = canonical_shapes(config)
    with torch.device("meta"):
        model = DecoderLM(config, tp).to(dtype)
    model.to_empty(device=device)
    cos, sin = rope_tables_for(config)
    model.rope_cos, model.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
    for name, param in model.state_dict().items():
        dim = rollout_split_dim(name)
        lo, hi = (0, full[name][0]) if dim is None else rollout_range(name, full[name][dim], tp.size, tp.rank)
        param.copy_(source.read(name, 0 if dim is None else dim, lo, hi, dtype))
    return model.eval()
