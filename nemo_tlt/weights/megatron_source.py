"""One Megatron rank's shard, built straight from a canonical source: its own slices only, read once.

Contract: ``megatron_shard_items(source, cfg, layout, coords, dtype)`` yields, one tensor
at a time, exactly the ``(name, tensor)`` pairs of
``canonical_to_megatron(canonical, cfg, layout)[coords]`` cast to ``dtype`` (bit-identical;
tested), without building any other rank's shard or any full canonical tensor: every
piece is read from ``source`` (``nemo_tlt.weights.sources``) as one contiguous row or
column range, in ``dtype``. Each stored byte a rank needs is read once (``bytes_read``
ends at the shard's bytes less Megatron's vocabulary padding); the transient memory is
one Megatron tensor and its pieces. ``megatron_shard`` collects the pairs in a dict.

How: every Megatron layer tensor is a permutation of canonical rows (or columns) along
one dimension (``megatron_tensor_sources``); TP rank ``t`` owns positions
``[t * n, (t + 1) * n)`` of the full tensor (``n`` its part's length), and for every
layout here the canonical rows that land there form one contiguous range, which is read
and placed (``index_copy_``). Replicated tensors (norms) are read whole. Vocabulary
tensors are TP-split by rows of the padded vocabulary; padding rows are zeros.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import StateDict, check_megatron_biases, check_tp, megatron_tensor_sources
from nemo_tlt.weights.reshard import megatron_shard_shapes
from nemo_tlt.weights.sources import CanonicalSource, check_source

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_tensor(source: CanonicalSource, prefix: str, name: str, shape: torch.Size, tp_rank: int,
                  cfg: LMConfig, tp: int, dtype: torch.dtype) -> Tensor:
    """Megatron layer tensor ``name`` of TP rank ``tp_rank``, from the canonical tensors under ``prefix``."""
    dim, positions = megatron_tensor_sources(name, tp, cfg)
    size = shape[dim]
    total = sum(len(p) for p in positions.values())
    lo = 0 if size == total else tp_rank * size  # a part as long as the whole is replicated (norms)
    pieces = []
    for canonical, pos in positions.items():
        rows = ((pos >= lo) & (pos < lo + size)).nonzero().flatten()
        if len(rows) == 0:
            continue
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 != len(rows):
            raise ValueError(f"{name}: TP rank {tp_rank} keeps rows of {canonical} that are not one range")
        pieces.append((pos[rows] - lo, source.read(prefix + canonical, dim, first, last + 1, dtype)))
    if sum(len(where) for where, _ in pieces) != size:
        raise ValueError(f"{name}: the canonical tensors fill {sum(len(w) for w, _ in pieces)} of the {size} "
                         f"positions of TP rank {tp_rank}'s part")
    if len(pieces) == 1 and torch.equal(pieces[0][0], torch.arange(size)):
        return pieces[0][1]  # one piece, already in place
    out = torch.empty(shape, dtype=dtype)
    for where, piece in pieces:
        out.index_copy_(dim, where, piece)
    return out


def _vocab_part(source: CanonicalSource, canonical: str, shape: torch.Size, tp_rank: int, vocab: int,
                dtype: torch.dtype) -> Tensor:
    """TP rank ``tp_rank``'s rows of the padded vocabulary (zeros past ``vocab``)."""
    lo = tp_rank * shape[0]
    real = max(0, min(lo + shape[0], vocab) - lo)
    if real == shape[0]:
        return source.read(canonical, 0, lo, lo + real, dtype)
    out = torch.zeros(shape, dtype=dtype)
    if real:
        out[:real] = source.read(canonical, 0, lo, lo + real, dtype)
    return out


def megatron_shard_items(source: CanonicalSource, cfg: LMConfig, layout: ParallelLayout, coords: tuple[int, int],
                         dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The shard of Megatron rank ``coords`` = (pipeline stage, TP rank), tensor by tensor (see the
    module docstring). The source is checked against ``cfg`` first."""
    check_megatron_biases(cfg)
    check_tp(cfg, layout.tp)
    check_source(source, cfg)
    stage, tp_rank = coords
    shapes = megatron_shard_shapes(cfg, layout)
    if coords not in shapes:
        raise ValueError(f"megatron_shard_items: coords {coords} lie outside TP={layout.tp} x PP={layout.pp}")
    offset = layout.stage_layer_offsets(cfg.num_layers)[stage]
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for name, shape in shapes[coords].items():
        m = _LAYER.match(name)
        if m:
            prefix = f"model.layers.{offset + int(m.group(1))}."
            yield name, _layer_tensor(source, prefix, m.group(2), shape, tp_rank, cfg, layout.tp, dtype)
        elif name == "embedding.word_embeddings.weight":
            yield name, _vocab_part(source, "model.embed_tokens.weight", shape, tp_rank, cfg.vocab_size, dtype)
        elif name == "output_layer.weight":
            yield name, _vocab_part(source, head, shape, tp_rank, cfg.vocab_size, dtype)
        elif name == "decoder.final_layernorm.weight":
            yield name, source.read("model.norm.weight", 0, 0, cfg.hidden_size, dtype)
        else:
            raise ValueError(f"megatron_shard_items: no canonical source for {name!r}")


def megatron_shard(source: CanonicalSource, cfg: LMConfig, layout: ParallelLayout, coords: tuple[int, int],
                   dtype: torch.dtype) -> StateDict:
    """``dict(megatron_shard_items(...))``: one rank's whole shard."""
    return dict(megatron_shard_items(source, cfg, layout, coords, dtype))
