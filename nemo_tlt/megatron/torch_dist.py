"""Megatron ``torch_dist`` checkpoints <-> canonical weights, through megatron-core itself.

Contract:
* ``save_torch_dist(canonical, cfg, layout, out_dir)`` is collective over a
  world already set up with ``init_model_parallel(layout.tp, layout.pp)``:
  every rank builds its GPTModel shard, loads its part of ``canonical`` and
  megatron's ``dist_checkpointing.save`` writes the checkpoint. Our
  ``LMConfig`` is stored in the common state under ``nemo_tlt.lm_config``.
* ``load_torch_dist(ckpt_dir, cfg=None)`` is collective too (any TP/PP, usually
  a world of one at TP=PP=1): megatron reshards on load, then the shard(s) are
  converted to canonical and returned on global rank 0. ``cfg`` is needed only
  for checkpoints written by other tools (no ``nemo_tlt.lm_config``).

The on-disk format is parallelism-agnostic (global tensors, layers stacked), so
the TP/PP a checkpoint is written with only decides who writes which slice.
Needs megatron-core (lazy imports) and, on CPU, ``megatron_patches.cpu_shims``.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import StateDict, canonical_to_megatron

_COMMON_KEY = "nemo_tlt"
_MODEL_KEY = "model"


def _build(cfg: LMConfig, layout: ParallelLayout, dtype: torch.dtype, padded_vocab: int | None = None):
    from nemo_tlt.megatron.gpt_builder import build_gpt_model

    return build_gpt_model(cfg, layout, dtype=dtype, padded_vocab_size=padded_vocab)


def save_torch_dist(canonical: Mapping[str, torch.Tensor], cfg: LMConfig, layout: ParallelLayout,
                    out_dir: str | os.PathLike) -> None:
    from nemo_tlt.megatron.live import load_shard, rank_coords
    from nemo_tlt.megatron.policy_checkpoint import save_policy_shards

    # The model is built in the weights' dtype (fp32 / bf16) so saving never casts.
    model = _build(cfg, layout, next(iter(canonical.values())).dtype)
    shards = canonical_to_megatron(canonical, cfg, layout)
    load_shard(model, shards[rank_coords()])
    state = {_MODEL_KEY: model.sharded_state_dict(),
             _COMMON_KEY: {"lm_config": cfg.to_dict(), "tp": layout.tp, "pp": layout.pp}}
    save_policy_shards(state, out_dir)  # megatron-core's save, with a results server that dies with the rank


def read_lm_config(ckpt_dir: str | os.PathLike) -> LMConfig | None:
    """Our config from the checkpoint's common state, or None for foreign checkpoints."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    meta = common.get(_COMMON_KEY) if isinstance(common, dict) else None
    return LMConfig(**meta["lm_config"]) if meta else None


def _embedding_meta(ckpt_dir: str | os.PathLike) -> tuple[int, torch.dtype]:
    """(padded vocab, dtype) of the stored embedding."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    for key, tensor in meta.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(tensor.global_shape[0]), tensor.dtype
    raise ValueError(f"{ckpt_dir}: no embedding.word_embeddings.weight in the checkpoint")


def load_torch_dist(ckpt_dir: str | os.PathLike, layout: ParallelLayout,
                    cfg: LMConfig | None = None) -> tuple[LMConfig, StateDict | None]:
    from megatron.core import dist_checkpointing
    from nemo_tlt.megatron.live import gather_canonical, load_shard

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: not a directory")
    stored = read_lm_config(ckpt_dir)
    if cfg is None:
        if stored is None:
            raise ValueError(f"{ckpt_dir}: checkpoint carries no nemo_tlt.lm_config; pass the model config "
                             "(an HF config.json) explicitly")
        cfg = stored
    padded_vocab, dtype = _embedding_meta(ckpt_dir)
    model = _build(cfg, layout, dtype, padded_vocab)
    try:
        loaded = dist_checkpointing.load({_MODEL_KEY: model.sharded_state_dict()}, str(ckpt_dir))
    except Exception as err:  # megatron raises several types; re-raise with the file named, keep the cause
        raise ValueError(f"{ckpt_dir}: checkpoint does not match the model config: {err}") from err
    load_shard(model, loaded[_MODEL_KEY])
    return cfg, gather_canonical(model, cfg, layout)
