"""Adapters for *live* megatron-core GPTModel shards (one per rank, inside a process group).

Contract: ``local_shard(model)`` is this rank's state dict without the
``_extra_state`` entries; ``load_shard(model, shard)`` loads one produced by
``canonical_to_megatron`` and fails loudly on any missing or unexpected weight;
``load_shard_items(model, items, spec)`` does the same from a stream of ``(name, tensor)``
pairs (``nemo_tlt.weights.megatron_source``), copying each into its weight as it comes so
that no second copy of the shard exists;
``spec_names(shard, spec)`` renames a local-spec shard's norms to Transformer Engine's
fused names; ``gather_canonical(model, cfg, layout)`` collects every rank's shard on global rank 0
and returns the canonical state dict there (``None`` elsewhere): the simple
gather-everything path, fine for tests and small models; use
``nemo_tlt.weights.reshard`` to move large models layer by layer.

Requires megatron's ``parallel_state`` to be initialised (imports are lazy so the
package imports without megatron-core).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import StateDict, megatron_to_canonical


def rank_coords() -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank) of this process."""
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank())


def local_shard(model: torch.nn.Module) -> StateDict:
    return {k: v.detach() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}


def load_shard(model: torch.nn.Module, shard: Mapping[str, torch.Tensor]) -> None:
    result = model.load_state_dict(dict(shard), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"load_shard: missing weights {missing}, unexpected weights {result.unexpected_keys}")


@torch.no_grad()
def load_shard_items(model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]], spec: str) -> None:
    """Copy local-spec ``(name, tensor)`` pairs into ``model`` one by one (renamed for ``spec``); every
    weight of the model must come exactly once, with its shape."""
    own = {k: v for k, v in model.state_dict(keep_vars=True).items()
           if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}
    seen: set[str] = set()
    unexpected = []
    for name, tensor in items:
        (name, tensor), = spec_names({name: tensor}, spec).items()
        if name not in own or name in seen:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"load_shard_items: {name} has shape {tuple(tensor.shape)}, the model's is "
                             f"{tuple(own[name].shape)}")
        own[name].copy_(tensor)
        seen.add(name)
    missing = sorted(set(own) - seen)
    if missing or unexpected:
        raise ValueError(f"load_shard_items: missing weights {missing}, unexpected or repeated weights {unexpected}")


# local-spec norm names -> Transformer Engine's (its norms are fused into the next linear)
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def spec_names(shard: Mapping[str, torch.Tensor], spec: str) -> dict[str, torch.Tensor]:
    """A local-spec shard (``canonical_to_megatron``) under the names of the layer spec ``spec``."""
    if spec == "local":
        return dict(shard)
    out = {}
    for name, value in shard.items():
        for local, te in _TE_NORMS.items():
            if name.startswith("decoder.layers.") and name.endswith("." + local):
                name = name[: -len(local)] + te
                break
        out[name] = value
    return out


def gather_canonical(model: torch.nn.Module, cfg: LMConfig, layout: ParallelLayout) -> StateDict | None:
    """All shards -> global rank 0 (object gather) -> canonical on rank 0."""
    mine = (rank_coords(), local_shard(model))
    everything: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if everything is None:
        return None
    shards = {coords: shard for coords, shard in everything}  # data-parallel replicas collapse
    return megatron_to_canonical(shards, cfg, layout)
