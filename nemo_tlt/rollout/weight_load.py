"""Policy weights into the embedded engine: the checks of one streamed ``(name, tensor)``
item, and the engine's compute copy of its target (``rollout.compute_dtype``)."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.rope import rope_tables_for


def compute_copy(target: DecoderLM, dtype: torch.dtype | None) -> DecoderLM:
    """`target`, or a copy of it computing in `dtype` (its weights' values kept: a bf16
    weight is exact in fp32). The rotary tables are recomputed in fp32, as the model
    builds them, rather than carried over from a lower precision."""
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
