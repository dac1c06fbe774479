"""Canonical weights -> the rollout engine's layout at tensor-parallel size ``tp``.

Contract: the rollout engine speaks canonical (HF) names. At ``tp == 1`` its
weights *are* the canonical state dict (what ``DecoderLM.load_state_dict``
takes). At ``tp > 1`` rank ``r`` gets, still under canonical names, the usual
Megatron-style split: q/k/v projections (and biases) by output rows, i.e. by
whole heads / kv heads; ``o_proj`` and ``down_proj`` by input columns;
``gate_proj`` / ``up_proj`` by rows; embedding and lm_head by vocab rows
(``torch.tensor_split``: no padding, parts differ by at most one row); norms whole.

The rule itself (``check_rollout_tp``, ``vocab_rows``, ``rollout_split_dim``,
``rollout_range``, ``rollout_slice``) is defined in ``nemo_tlt.model.tp_layout``,
where the tensor-parallel ``DecoderLM`` builds its local parameters from it, and
re-exported here. ``rollout_slice`` works one tensor at a time so the streaming
reshard never holds more than one full tensor.
"""
from __future__ import annotations

from typing import Mapping

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.tp_layout import check_rollout_tp, rollout_range, rollout_slice, rollout_split_dim, vocab_rows

__all__ = ["check_rollout_tp", "vocab_rows", "rollout_split_dim", "rollout_range", "rollout_slice",
           "canonical_to_rollout"]


def canonical_to_rollout(canonical: Mapping[str, torch.Tensor], cfg: LMConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """All ``tp`` rollout shards (contiguous clones) of a canonical state dict."""
    check_rollout_tp(cfg, tp)
    return [{name: rollout_slice(name, t, tp, r).clone() for name, t in canonical.items()} for r in range(tp)]
