"""The rollout tensor-parallel layout: which part of each canonical tensor a TP rank holds.

Contract: at ``tp == 1`` a rank holds every canonical (HF-named) tensor whole. At
``tp > 1`` rank ``r`` holds, under the same canonical names, the usual Megatron-style
split: q/k/v projections (and biases) by output rows, i.e. by whole heads / kv heads;
``o_proj`` and ``down_proj`` by input columns; ``gate_proj`` / ``up_proj`` by rows;
embedding and lm_head by vocab rows (``torch.tensor_split``: no padding, parts differ
by at most one row); norms whole. An attention output-projection bias (``o_proj.bias``)
has no rule: a TP model refuses it (it would be added once per rank).

The rule lives in the model layer because the tensor-parallel ``DecoderLM`` builds its
local parameters from it; ``nemo_tlt.weights.rollout`` re-exports it for the converters
and the streaming reshard. ``rollout_slice`` works one tensor at a time.
"""
from __future__ import annotations

import torch

from nemo_tlt.model.config import LMConfig

_ROW_SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
              "gate_proj.weight", "up_proj.weight")
_COL_SPLIT = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_rollout_tp(cfg: LMConfig, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"rollout tp must be >= 1, got {tp}")
    problems = [f"{n}={getattr(cfg, n)}" for n in ("num_heads", "num_kv_heads", "intermediate_size")
                if getattr(cfg, n) % tp]
    if problems:
        raise ValueError(f"rollout TP={tp} does not divide {', '.join(problems)}")


def vocab_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Row range ``[lo, hi)`` of rollout rank ``rank`` in a vocab-parallel tensor (``tensor_split`` rule)."""
    base, extra = divmod(vocab, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def rollout_split_dim(name: str) -> int | None:
    """The dimension along which the rollout engine splits canonical tensor ``name`` (None: kept whole)."""
    if name in _VOCAB or name.endswith(_ROW_SPLIT):
        return 0
    if name.endswith(_COL_SPLIT):
        return 1
    if name.endswith("norm.weight"):
        return None
    raise ValueError(f"rollout_slice: no TP rule for canonical tensor {name!r}")


def rollout_range(name: str, size: int, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rollout rank ``rank`` along ``rollout_split_dim(name)``, of a tensor ``size`` long
    there (vocab: ``tensor_split`` rows; others: ``chunk``; a whole tensor: ``(0, size)``)."""
    dim = rollout_split_dim(name)
    if tp == 1 or dim is None:
        return 0, size
    if name in _VOCAB:
        return vocab_rows(size, tp, rank)
    step = -(-size // tp)
    lo = min(size, rank * step)
    return lo, min(size, lo + step)


def rollout_slice(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of one canonical tensor (always a view; the tensor itself when ``tp == 1``)."""
    dim = rollout_split_dim(name)
    if tp == 1 or dim is None:
        return tensor
    lo, hi = rollout_range(name, tensor.shape[dim], tp, rank)
    return tensor.narrow(dim, lo, hi - lo)
