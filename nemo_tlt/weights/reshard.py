"""Reshard live Megatron TP x PP shards to rollout-engine shards at TP ``t``, streamed.

Contract: ``stream_reshard(shard, plan)`` is called on every rank of the world
with that rank's Megatron shard (``local_shard(model)``). Tensors move in a
fixed global order (stage, local layer, tensor name, TP part): the owning rank
broadcasts each TP part, every receiver converts that one tensor to canonical
form, keeps only its rollout slice, and drops the rest before the next tensor
arrives. Peak *extra* memory per rank is therefore about one full weight
matrix (bounded by one layer), never the model. Receiver ``i`` of
``plan.receivers`` gets rollout TP rank ``i % plan.rollout_tp`` and returns its
shard in canonical names (see ``nemo_tlt.weights.rollout``); other ranks return None.

``gather_reshard`` is the reference: receivers first collect every shard of the
model, then convert it whole. Both count their transient bytes in a
``ByteMeter`` so the benchmark can report peak extra memory per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import (
    StateDict, canonical_layer_to_megatron, check_megatron_biases, check_tp, megatron_layer_to_canonical, megatron_tensor_to_canonical,
    megatron_to_canonical_ends,
)
from nemo_tlt.weights.rollout import check_rollout_tp, rollout_slice, vocab_rows


@dataclass
class ByteMeter:
    """Counts bytes of transient tensors; ``peak`` is the high-water mark."""
    current: int = 0
    peak: int = 0

    def add(self, *tensors: torch.Tensor) -> None:
        self.current += sum(t.numel() * t.element_size() for t in tensors)
        self.peak = max(self.peak, self.current)

    def sub(self, *tensors: torch.Tensor) -> None:
        self.current -= sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ReshardPlan:
    cfg: LMConfig
    layout: ParallelLayout
    rollout_tp: int
    receivers: tuple[int, ...] = ()  # global ranks; empty means every rank
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # where buffers live: "cpu" under gloo, "cuda" under NCCL
    meter: ByteMeter = field(default_factory=ByteMeter, compare=False)

    def __post_init__(self) -> None:
        check_megatron_biases(self.cfg)
        check_tp(self.cfg, self.layout.tp)
        check_rollout_tp(self.cfg, self.rollout_tp)
        if len(set(self.receivers)) != len(self.receivers):
            raise ValueError(f"ReshardPlan.receivers has duplicates: {self.receivers}")


def _rank_table() -> dict[tuple[int, int], int]:
    """(pp, tp) -> the global rank that sends it (the data-parallel replica 0)."""
    from megatron.core import parallel_state

    mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(), dist.get_rank())
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return {(p, t): g for p, t, d, g in table if d == 0}


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


# Process groups of the movers, made once per world and reused by every later call
# (the RL loop reshards after every step; gloo groups hold sockets and threads).
# new_group is collective: every rank asks for the same member lists in the same
# order, so every rank hits or misses alike. The default group is kept with them: a
# re-initialised world gets new groups.
_GROUPS: dict[tuple[int, ...], object] = {}
_GROUPS_WORLD: list = [None]
_GROUPS_MADE = [0]


def _group(members: list[int]):
    world = dist.group.WORLD
    if _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    key = tuple(members)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(members)
        _GROUPS_MADE[0] += 1
    return _GROUPS[key]


def groups_created() -> int:
    """How many mover process groups this process has created (for tests and logs)."""
    return _GROUPS_MADE[0]


class _Mover:
    """Broadcasts one (pp, tp) tensor from its owner to the receivers, counting bytes."""

    def __init__(self, shard: StateDict, plan: ReshardPlan) -> None:
        self.shard, self.plan = shard, plan
        self.owner = _rank_table()
        self.me = dist.get_rank()
        world = dist.get_world_size()
        self.receivers = plan.receivers or tuple(range(world))
        self.shapes = megatron_shard_shapes(plan.cfg, plan.layout)
        # One group per pipeline stage: its senders plus all receivers (see _group).
        self.groups = {}
        for p in range(plan.layout.pp):
            members = sorted({self.owner[(p, t)] for t in range(plan.layout.tp)} | set(self.receivers))
            self.groups[p] = (members, _group(members))

    @property
    def receiving(self) -> bool:
        return self.me in self.receivers

    def fetch(self, p: int, name: str) -> list[torch.Tensor] | None:
        """All TP parts of ``name`` at stage ``p`` on receivers (counted in the meter), None elsewhere."""
        parts = [self.fetch_part(p, name, t) for t in range(self.plan.layout.tp)]
        return parts if self.receiving else None

    def fetch_part(self, p: int, name: str, t: int) -> torch.Tensor | None:
        """TP part ``t`` of ``name``; on ranks that only relay it, the buffer is freed at once."""
        members, group = self.groups[p]
        if self.me not in members:
            return None
        src = self.owner[(p, t)]
        if self.me == src:
            buf = self.shard[name].to(self.plan.device, self.plan.dtype).contiguous()
        else:
            buf = torch.empty(self.shapes[(p, t)][name], dtype=self.plan.dtype, device=self.plan.device)
            self.plan.meter.add(buf)
        dist.broadcast(buf, src=src, group=group)
        if not self.receiving:
            self.release_part(p, t, buf)
            return None
        return buf

    def release_part(self, p: int, t: int, buf: torch.Tensor) -> None:
        if self.owner[(p, t)] != self.me:
            self.plan.meter.sub(buf)

    def _release(self, p: int, parts: list[torch.Tensor]) -> None:
        for t, buf in enumerate(parts):
            self.release_part(p, t, buf)

    def rollout_rank(self) -> int:
        return self.receivers.index(self.me) % self.plan.rollout_tp


def stream_reshard(shard: StateDict, plan: ReshardPlan) -> StateDict | None:
    mover = _Mover(shard, plan)
    cfg, layout = plan.cfg, plan.layout
    out: StateDict = {}
    counts, offsets = layout.stage_layer_counts(cfg.num_layers), layout.stage_layer_offsets(cfg.num_layers)
    rank = mover.rollout_rank() if mover.receiving else 0

    def keep(name: str, full: torch.Tensor) -> None:
        out[name] = rollout_slice(name, full, plan.rollout_tp, rank).clone()

    for p in range(layout.pp):
        for local in range(counts[p]):
            for mname in sorted(k.split(".", 3)[3] for k in mover.shapes[(p, 0)]
                                if k.startswith(f"decoder.layers.{local}.")):
                parts = mover.fetch(p, f"decoder.layers.{local}.{mname}")
                if parts is None:
                    continue
                converted = megatron_tensor_to_canonical(mname, parts, cfg)
                # cat() makes new full tensors; count them while they live.
                plan.meter.add(*[t for t in converted.values() if t.data_ptr() != parts[0].data_ptr()])
                for cname, full in converted.items():
                    keep(f"model.layers.{offsets[p] + local}.{cname}", full)
                plan.meter.sub(*[t for t in converted.values() if t.data_ptr() != parts[0].data_ptr()])
                mover._release(p, parts)
    _stream_ends(mover, keep, out)
    return out if mover.receiving else None


def _stream_ends(mover: _Mover, keep, out: StateDict) -> None:
    plan, cfg = mover.plan, mover.plan.cfg
    last = plan.layout.pp - 1
    parts = mover.fetch(last, "decoder.final_layernorm.weight")
    if parts is not None:
        keep("model.norm.weight", parts[0])
        mover._release(last, parts)
    vocab = [(0, "embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    if not cfg.tie_word_embeddings:
        vocab.append((last, "output_layer.weight", "lm_head.weight"))
    for p, mname, cname in vocab:
        _stream_vocab(mover, p, mname, cname, out)


def _stream_vocab(mover: _Mover, p: int, mname: str, cname: str, out: StateDict) -> None:
    """Copy each received vocab part's rows straight into this rollout rank's slice.

    The embedding is usually the largest single tensor; never materialising it whole
    keeps the streaming peak at one TP part of it.
    """
    plan, cfg = mover.plan, mover.plan.cfg
    lo, hi = (vocab_rows(cfg.vocab_size, plan.rollout_tp, mover.rollout_rank()) if mover.receiving
              else (0, 0))
    dest = (torch.empty((hi - lo, cfg.hidden_size), dtype=plan.dtype, device=plan.device)
            if mover.receiving else None)
    part_rows = plan.layout.padded_vocab_size(cfg.vocab_size) // plan.layout.tp
    for t in range(plan.layout.tp):
        part = mover.fetch_part(p, mname, t)
        if part is None:
            continue
        start, stop = max(lo, t * part_rows), min(hi, (t + 1) * part_rows)
        if start < stop:
            dest[start - lo: stop - lo] = part[start - t * part_rows: stop - t * part_rows]
        mover.release_part(p, t, part)
    if dest is not None:
        out[cname] = dest


def gather_reshard(shard: StateDict, plan: ReshardPlan) -> StateDict | None:
    """Reference: receivers first hold every shard of the model at once, then convert.

    Conversion then consumes the gathered shards layer by layer (freeing each as it
    goes), so the peak is the whole gathered model, as for any gather-then-convert
    sync, without a second full copy on top.
    """
    mover = _Mover(shard, plan)
    layout, cfg = plan.layout, plan.cfg
    gathered: dict[tuple[int, int], StateDict] = {(p, t): {} for p in range(layout.pp) for t in range(layout.tp)}
    for p in range(layout.pp):
        for name in sorted(mover.shapes[(p, 0)]):
            parts = mover.fetch(p, name)
            for t, part in enumerate(parts or []):
                gathered[(p, t)][name] = part
    if not mover.receiving:
        return None
    rank = mover.rollout_rank()
    out: StateDict = {}
    counts, offsets = layout.stage_layer_counts(cfg.num_layers), layout.stage_layer_offsets(cfg.num_layers)
    for p in range(layout.pp):
        for local in range(counts[p]):
            prefix = f"decoder.layers.{local}."
            tp_layers = [{k[len(prefix):]: gathered[(p, t)].pop(k) for k in list(gathered[(p, t)])
                          if k.startswith(prefix)} for t in range(layout.tp)]
            for cname, full in megatron_layer_to_canonical(tp_layers, cfg).items():
                out[f"model.layers.{offsets[p] + local}.{cname}"] = rollout_slice(
                    cname, full, plan.rollout_tp, rank).clone()
            for name in tp_layers[0]:
                mover._release(p, [tl[name] for tl in tp_layers])
    rest = {(p, t): sd for (p, t), sd in gathered.items()}
    ends = megatron_to_canonical_ends(rest, cfg, layout)
    for cname, full in ends.items():
        out[cname] = rollout_slice(cname, full, plan.rollout_tp, rank).clone()
    for p in range(layout.pp):
        for name in list(gathered[(p, 0)]):
            mover._release(p, [gathered[(p, t)].pop(name) for t in range(layout.tp)])
    return out


__all__ = ["ByteMeter", "ReshardPlan", "megatron_shard_shapes", "stream_reshard", "gather_reshard"]
