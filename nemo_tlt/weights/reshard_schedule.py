"""The slice-only reshard's schedule: what each rollout TP rank keeps of every canonical
tensor, and from which Megatron TP part it comes. Pure (no process group, meta shapes only);
``nemo_tlt.weights.reshard`` executes it, ``nemo_tlt.plan.reshard_plan`` counts its bytes.

Contract: ``megatron_shard_shapes(cfg, layout)`` is every (pp, tp) rank's Megatron shard
shapes; ``reshard_schedule(cfg, layout, rollout_tp)`` yields one ``Transfer`` per canonical
tensor in a fixed global order, whose ``slices[r]`` lists the ``Piece`` s rollout rank r
takes from each TP part (source positions in the part, destination positions in its slice).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import canonical_layer_to_megatron, check_megatron_biases, megatron_tensor_sources
from nemo_tlt.weights.rollout import check_rollout_tp, rollout_range, rollout_split_dim


def megatron_shard_shapes(cfg: LMConfig, layout: ParallelLayout) -> dict[tuple[int, int], dict[str, torch.Size]]:
    """Every rank's shard shapes (no ``_extra_state``), derived on the meta device: no memory."""
    meta_layer = {name: torch.empty(shape, device="meta") for name, shape in _canonical_layer_shapes(cfg).items()}
    layer_shapes = [{k: v.shape for k, v in shard.items()}
                    for shard in canonical_layer_to_megatron(meta_layer, cfg, layout.tp)]
    padded = layout.padded_vocab_size(cfg.vocab_size) // layout.tp
    vocab_shape = torch.Size((padded, cfg.hidden_size))
    last = layout.pp - 1
    out: dict[tuple[int, int], dict[str, torch.Size]] = {}
    for p, count in enumerate(layout.stage_layer_counts(cfg.num_layers)):
        for t in range(layout.tp):
            shard = {f"decoder.layers.{local}.{k}": v for local in range(count) for k, v in layer_shapes[t].items()}
            if p == 0:
                shard["embedding.word_embeddings.weight"] = vocab_shape
            if p == last:
                shard["decoder.final_layernorm.weight"] = torch.Size((cfg.hidden_size,))
                if not cfg.tie_word_embeddings or layout.pp > 1:
                    shard["output_layer.weight"] = vocab_shape
            out[(p, t)] = shard
    return out


def _canonical_layer_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    # A Megatron layer never holds an o_proj bias (refused here rather than left out of the shapes).
    check_megatron_biases(cfg)
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    return shapes


@dataclass(frozen=True)
class Piece:
    """The rows (or columns) of TP part ``part`` that one rollout slice takes: ``src`` along the
    transfer's dim in the part, landing at ``dst`` in the slice."""
    part: int
    src: torch.Tensor
    dst: torch.Tensor
    shape: torch.Size  # of the piece as it travels


@dataclass(frozen=True)
class SliceSpec:
    shape: torch.Size  # the rollout slice
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Transfer:
    """One canonical tensor: it comes from megatron tensor ``key`` of stage ``stage``;
    ``slices[r]`` is what rollout rank ``r`` keeps of it."""
    name: str
    stage: int
    key: str
    dim: int
    slices: tuple[SliceSpec, ...]


def _slices(name: str, dim: int, positions: torch.Tensor, part_shape: torch.Size, rollout_tp: int
            ) -> tuple[SliceSpec, ...]:
    """Cut the canonical tensor's source positions (in ``cat(parts, dim)``) into per-rollout-rank pieces."""
    split = rollout_split_dim(name)
    if split is not None and split != dim:
        raise ValueError(f"reshard: {name} is split by the rollout engine along dim {split}, "
                         f"but assembled along dim {dim}")
    n = part_shape[dim]
    out = []
    for r in range(rollout_tp):
        lo, hi = rollout_range(name, len(positions), rollout_tp, r)
        mine = positions[lo:hi]
        owner = mine // n
        pieces = []
        for t in owner.unique(sorted=True).tolist():
            at = (owner == t).nonzero().flatten()
            shape = list(part_shape)
            shape[dim] = len(at)
            pieces.append(Piece(t, mine[at] - t * n, at, torch.Size(shape)))
        shape = list(part_shape)
        shape[dim] = hi - lo
        out.append(SliceSpec(torch.Size(shape), tuple(pieces)))
    return tuple(out)


def reshard_schedule(cfg: LMConfig, layout: ParallelLayout, rollout_tp: int) -> Iterator[Transfer]:
    """Every canonical tensor in the global order (stage, local layer, megatron tensor, its canonical
    tensors; then the final norm, the embedding, the output layer), with what each rollout rank keeps.

    Pure and cheap: the slices of a layer tensor are computed once per stage and shared by its layers.
    The streaming reshard executes it; ``nemo_tlt.plan.reshard_plan`` counts its bytes.
    """
    check_rollout_tp(cfg, rollout_tp)
    shapes = megatron_shard_shapes(cfg, layout)
    counts, offsets = layout.stage_layer_counts(cfg.num_layers), layout.stage_layer_offsets(cfg.num_layers)
    for p in range(layout.pp):
        if counts[p] == 0:
            continue
        per_tensor = []
        for mname in sorted(k.split(".", 3)[3] for k in shapes[(p, 0)] if k.startswith("decoder.layers.0.")):
            part_shape = shapes[(p, 0)][f"decoder.layers.0.{mname}"]
            dim, sources = megatron_tensor_sources(mname, layout.tp, cfg)
            per_tensor.append((mname, dim, [(cname, _slices(cname, dim, pos, part_shape, rollout_tp))
                                            for cname, pos in sources.items()]))
        for local in range(counts[p]):
            for mname, dim, canon in per_tensor:
                for cname, slices in canon:
                    yield Transfer(f"model.layers.{offsets[p] + local}.{cname}", p,
                                   f"decoder.layers.{local}.{mname}", dim, slices)
    last = layout.pp - 1
    ends = [(last, "decoder.final_layernorm.weight", "model.norm.weight", torch.arange(cfg.hidden_size)),
            (0, "embedding.word_embeddings.weight", "model.embed_tokens.weight", torch.arange(cfg.vocab_size))]
    if not cfg.tie_word_embeddings:
        ends.append((last, "output_layer.weight", "lm_head.weight", torch.arange(cfg.vocab_size)))
    for p, key, cname, positions in ends:
        yield Transfer(cname, p, key, 0, _slices(cname, 0, positions, shapes[(p, 0)][key], rollout_tp))
