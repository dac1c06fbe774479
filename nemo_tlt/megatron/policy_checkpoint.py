"""Sharded checkpoints of a megatron policy: weights, fp32 masters and AdamW state, per rank.

Contract (every function collective over the whole world, megatron's parallel state set up):
* ``policy_sharded_state(model, params, masters, optimizer)`` is megatron-core's sharded
  state dict of the policy: the model's own ``sharded_state_dict()`` (global tensors,
  layers stacked, so the file layout does not depend on TP / PP / DP), the AdamW moments
  of every parameter with that parameter's sharding (megatron's
  ``optim_state_to_sharding_state``, as its own optimizers save theirs) and, for bf16
  weights, the fp32 masters the same way. The AdamW step is common (equal for all).
* ``save_policy_shards(...)`` writes it with ``dist_checkpointing.save`` (torch_dist
  format): each rank writes the tensors it is the main replica of (data-parallel copies
  are written once), rank 0 the small common state. Nothing is gathered on any rank.
* ``load_policy_shards(...)`` reads back this rank's slice at the *current* TP / PP / DP:
  a different data-parallel size always works (replicas read the same slices); a
  different TP / PP works where the global tensors agree, and is refused, naming the saved
  and current layouts, where they cannot (Megatron pads the vocabulary to a multiple of
  128 x TP, so the embedding's global shape depends on TP). Another dtype or model config
  is refused too.

A state before the first update has no AdamW moments; ``ensure_adam_state`` gives every
parameter the zero moments and step 0 a fresh AdamW starts from (the next step then
computes exactly what it would have), so saved and loaded structures always match.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout

COMMON = "nemo_tlt"


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state AdamW's initial state (step 0, zero moments)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _adam_step(optimizer: torch.optim.Optimizer) -> float:
    steps = {float(s["step"]) for s in optimizer.state.values()}
    if len(steps) != 1:
        raise ValueError(f"policy checkpoint: AdamW steps differ between parameters: {sorted(steps)}")
    return steps.pop()


def policy_sharded_state(model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                         masters: Sequence[torch.nn.Parameter] | None, optimizer: torch.optim.Optimizer,
                         common: dict) -> dict:
    """The sharded state dict (see the module docstring); ``masters`` None for fp32 weights."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor,
    )

    ensure_adam_state(optimizer)
    model_state = model.sharded_state_dict()
    by_id = get_param_id_to_sharded_param_map(model_state, params)
    if len(by_id) != len(params):
        raise RuntimeError(f"policy checkpoint: {len(params) - len(by_id)} trained parameters have no sharded "
                           "counterpart in the model's sharded_state_dict")
    # the optimizer's params are the masters (bf16) or the params (fp32), in the same order
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    moments = {i: {key: make_sharded_optimizer_tensor(by_id[i], optimizer.state[p][key], f"optimizer.state.{key}")
                   for key in ("exp_avg", "exp_avg_sq")} for i, p in enumerate(opt_params)}
    state = {"model": model_state, "optimizer": moments,
             COMMON: {**common, "adam_step": _adam_step(optimizer)}}
    if masters is not None:
        state["master"] = {i: make_sharded_optimizer_tensor(by_id[i], m, "master") for i, m in enumerate(masters)}
    return state


def layout_common(cfg: LMConfig, layout: ParallelLayout, dtype: torch.dtype, step: int) -> dict:
    return {"lm_config": cfg.to_dict(), "tp": layout.tp, "pp": layout.pp,
            "padded_vocab": layout.padded_vocab_size(cfg.vocab_size), "dtype": str(dtype), "step": step}


def save_policy_shards(state: dict, directory: str | os.PathLike) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(state, str(directory))


def check_compatible(saved: dict, current: dict, where: str) -> None:
    """Refuse a checkpoint this policy cannot continue, naming what differs."""
    if saved["lm_config"] != current["lm_config"]:
        diff = sorted(k for k in set(saved["lm_config"]) | set(current["lm_config"])
                      if saved["lm_config"].get(k) != current["lm_config"].get(k))
        raise ValueError(f"resume: {where} holds another model (config fields differ: {diff})")
    if saved["dtype"] != current["dtype"]:
        raise ValueError(f"resume: {where} holds {saved['dtype']} weights; this run trains {current['dtype']} "
                         "(model.dtype)")
    if saved["padded_vocab"] != current["padded_vocab"]:
        raise ValueError(
            f"resume: {where} was written at TP={saved['tp']} x PP={saved['pp']}, whose padded vocabulary has "
            f"{saved['padded_vocab']} rows; at TP={current['tp']} x PP={current['pp']} it has "
            f"{current['padded_vocab']} (Megatron pads to a multiple of 128 x TP), so the embedding cannot be "
            "resharded; resume at a TP with the same padded vocabulary")


def load_policy_shards(state: dict, directory: str | os.PathLike) -> dict:
    """Fill ``state`` (a ``policy_sharded_state`` of the live policy) from ``directory``; returns the
    loaded dict (plain tensors where ``state`` had sharded ones, the saved common state under COMMON)."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(directory))[COMMON]
    check_compatible(saved, state[COMMON], str(directory))
    if ("master" in state) != bool(saved["dtype"] != str(torch.float32)):
        raise ValueError(f"resume: {directory}: masters present / absent does not match dtype {saved['dtype']}")
    return dist_checkpointing.load(state, str(directory))
