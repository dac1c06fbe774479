"""Megatron-core GPTModel TP/PP shards <-> canonical (HF Llama / Qwen2 names).

Pure functions over state dicts; no torch.distributed. A *shard* is one rank's
``GPTModel.state_dict()`` (local-spec names, layers numbered from 0 inside its
pipeline stage). The Megatron layout, as read from megatron-core 0.16:

* ``linear_qkv`` rows are grouped per query group as
  ``[q (heads_per_group * head_dim), k (head_dim), v (head_dim)]`` and TP splits
  whole groups, so the full tensor is the plain concatenation of the TP shards;
* ``linear_fc1`` rows are ``[gate; up]`` per rank: rank r holds
  ``cat(gate.chunk(tp)[r], up.chunk(tp)[r])``;
* ``linear_proj`` / ``linear_fc2`` are split by input columns;
* ``embedding.word_embeddings`` / ``output_layer`` are split by (padded) vocab rows;
* norms are replicated; ``_extra_state`` entries carry no weights and are skipped;
  Transformer-Engine specs store the pre-attention / pre-MLP norms as
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (accepted on input).

Rotary embeddings are non-interleaved in both worlds, so q/k need no permutation.

Biases: q/k/v biases (Qwen2; megatron ``add_qkv_bias``) are supported. A Llama with
``attention_bias=True`` (``LMConfig.o_proj_bias``) also has an output-projection bias,
which megatron-core 0.16 cannot hold without MLP biases HF Llama lacks
(``add_bias_linear`` gives ``linear_proj``, ``linear_fc1`` and ``linear_fc2`` a bias
together), so every entry point here refuses such a config (``check_megatron_biases``).
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron layer-local name -> canonical layer-local name, for tensors that need no reshaping
# beyond a TP split handled in `megatron_layer_to_canonical`.
_NORM_ALIASES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}


def check_tp(cfg: LMConfig, tp: int) -> None:
    """Raise a clear ValueError when TP cannot split this model's heads / groups / MLP."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp:
        problems.append(f"num_kv_heads (query groups)={cfg.num_kv_heads}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise ValueError(f"TP={tp} does not divide {', '.join(problems)}")


def check_megatron_biases(cfg: LMConfig) -> None:
    """Raise a clear ValueError for biases megatron-core's GPTModel cannot hold exactly.

    Only an output-projection bias is at issue: megatron-core 0.16 gives ``linear_proj``
    a bias only through ``add_bias_linear``, which also gives ``linear_fc1`` /
    ``linear_fc2`` trainable biases that HF Llama (mlp_bias=false) has no place for.
    """
    if cfg.o_proj_bias:
        raise ValueError(
            "LMConfig.o_proj_bias is True (a Llama with attention_bias=true has q/k/v and o_proj biases); "
            "megatron-core cannot hold an o_proj bias without MLP biases (add_bias_linear adds linear_proj, "
            "linear_fc1 and linear_fc2 biases together), so the Megatron paths do not support it. Supported: "
            "no attention biases (Llama, attention_bias=false) or q/k/v biases only (Qwen2, add_qkv_bias)")


def _expect(t: Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {tuple(t.shape)}")


# ---- one transformer layer ----------------------------------------------------

def _split_grouped(full: Tensor, cfg: LMConfig, trailing: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group [q..., k, v] rows -> (q, k, v) in HF order (heads contiguous)."""
    hd, ng, nh = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    hpg = nh // ng
    grouped = full.view(ng, hpg + 2, hd, *trailing)
    return (grouped[:, :hpg].reshape(nh * hd, *trailing),
            grouped[:, hpg].reshape(ng * hd, *trailing),
            grouped[:, hpg + 1].reshape(ng * hd, *trailing))


def megatron_tensor_to_canonical(name: str, tp_parts: Sequence[Tensor], cfg: LMConfig) -> StateDict:
    """One megatron layer-local tensor, given as its TP parts -> the canonical tensors it holds.

    Working tensor by tensor (not layer by layer) keeps the streaming reshard's
    transient memory at one weight matrix.
    """
    h, nh, ng, hd, ffn = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if name in _NORM_ALIASES:
        return {_NORM_ALIASES[name]: tp_parts[0]}
    if name == "self_attention.linear_qkv.weight":
        full = torch.cat(list(tp_parts), dim=0)
        _expect(full, ((nh + 2 * ng) * hd, h), "linear_qkv.weight")
        q, k, v = _split_grouped(full, cfg, (h,))
        return {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v}
    if name == "self_attention.linear_qkv.bias":
        full = torch.cat(list(tp_parts), dim=0)
        _expect(full, ((nh + 2 * ng) * hd,), "linear_qkv.bias")
        q, k, v = _split_grouped(full, cfg, ())
        return {"self_attn.q_proj.bias": q, "self_attn.k_proj.bias": k, "self_attn.v_proj.bias": v}
    if name == "self_attention.linear_proj.weight":
        full = torch.cat(list(tp_parts), dim=1)
        _expect(full, (h, nh * hd), "linear_proj.weight")
        return {"self_attn.o_proj.weight": full}
    if name == "mlp.linear_fc1.weight":
        halves = [p.chunk(2, dim=0) for p in tp_parts]
        gate = torch.cat([g for g, _ in halves], dim=0)
        _expect(gate, (ffn, h), "linear_fc1.weight (gate half)")
        return {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": torch.cat([u for _, u in halves], dim=0)}
    if name == "mlp.linear_fc2.weight":
        full = torch.cat(list(tp_parts), dim=1)
        _expect(full, (h, ffn), "linear_fc2.weight")
        return {"mlp.down_proj.weight": full}
    raise ValueError(f"unknown megatron layer tensor {name!r} (MoE / MLA / bias-linear models are not supported)")


def megatron_tensor_sources(name: str, tp: int, cfg: LMConfig) -> tuple[int, dict[str, Tensor]]:
    """Where each canonical tensor held by megatron layer tensor ``name`` comes from, as positions.

    Returns ``(dim, {canonical name: positions})``: with ``full = cat(tp_parts, dim)``,
    ``megatron_tensor_to_canonical(name, tp_parts, cfg)[c]`` equals
    ``full.index_select(dim, positions[c])`` (tested). Every conversion is a permutation
    along one dimension, which is what lets the reshard send a rollout rank only the rows
    (or columns) it keeps. Norms are replicated: their positions all fall in part 0.
    """
    h, nh, ng, hd, ffn = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if name in _NORM_ALIASES:
        return 0, {_NORM_ALIASES[name]: torch.arange(h)}
    if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        q, k, v = _split_grouped(torch.arange((nh + 2 * ng) * hd), cfg, ())
        kind = name.rsplit(".", 1)[1]
        return 0, {f"self_attn.q_proj.{kind}": q, f"self_attn.k_proj.{kind}": k, f"self_attn.v_proj.{kind}": v}
    if name == "self_attention.linear_proj.weight":
        return 1, {"self_attn.o_proj.weight": torch.arange(nh * hd)}
    if name == "mlp.linear_fc1.weight":
        rows = 2 * ffn // tp  # each part is [gate_t; up_t]
        starts = torch.arange(tp).unsqueeze(1) * rows
        half = torch.arange(rows // 2).unsqueeze(0)
        return 0, {"mlp.gate_proj.weight": (starts + half).reshape(-1),
                   "mlp.up_proj.weight": (starts + rows // 2 + half).reshape(-1)}
    if name == "mlp.linear_fc2.weight":
        return 1, {"mlp.down_proj.weight": torch.arange(ffn)}
    raise ValueError(f"unknown megatron layer tensor {name!r} (MoE / MLA / bias-linear models are not supported)")


def megatron_layer_to_canonical(tp_shards: Sequence[Mapping[str, Tensor]], cfg: LMConfig) -> StateDict:
    """TP shards of one layer (megatron layer-local names) -> canonical layer-local dict."""
    check_megatron_biases(cfg)
    check_tp(cfg, len(tp_shards))
    names = [n for n in tp_shards[0] if not n.endswith("_extra_state")]
    if bool(cfg.qkv_bias) != ("self_attention.linear_qkv.bias" in names):
        raise ValueError(f"qkv bias presence in the checkpoint does not match qkv_bias={cfg.qkv_bias}")
    out: StateDict = {}
    for name in names:
        out.update(megatron_tensor_to_canonical(name, [s[name] for s in tp_shards], cfg))
    missing = layer_canonical_names(cfg) - set(out)
    if missing:
        raise ValueError(f"megatron layer is missing tensors for {sorted(missing)}")
    return out


QKV_BIAS_NAMES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
LAYER_CANONICAL_NAMES = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
) + QKV_BIAS_NAMES


def layer_canonical_names(cfg: LMConfig) -> set[str]:
    """The canonical layer-local names a Megatron layer of `cfg` holds (no o_proj bias: see
    check_megatron_biases)."""
    return set(LAYER_CANONICAL_NAMES) - (set() if cfg.qkv_bias else set(QKV_BIAS_NAMES))


def canonical_layer_to_megatron(layer: Mapping[str, Tensor], cfg: LMConfig, tp: int) -> list[StateDict]:
    """Canonical layer-local dict -> one megatron layer-local dict per TP rank.

    A tensor this layout has no place for is refused, never dropped."""
    check_megatron_biases(cfg)
    check_tp(cfg, tp)
    unexpected = sorted(set(layer) - layer_canonical_names(cfg))
    if unexpected:
        raise ValueError(f"canonical layer has tensors the Megatron layout cannot hold: {unexpected}")
    hd, ng, nh, h = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads, cfg.hidden_size
    hpg = nh // ng
    _expect(layer["self_attn.q_proj.weight"], (nh * hd, h), "q_proj.weight")
    _expect(layer["self_attn.k_proj.weight"], (ng * hd, h), "k_proj.weight")
    _expect(layer["self_attn.v_proj.weight"], (ng * hd, h), "v_proj.weight")
    qkv = torch.cat(
        [layer["self_attn.q_proj.weight"].view(ng, hpg, hd, h),
         layer["self_attn.k_proj.weight"].view(ng, 1, hd, h),
         layer["self_attn.v_proj.weight"].view(ng, 1, hd, h)], dim=1,
    ).reshape(-1, h)
    qkv_b = None
    if cfg.qkv_bias:
        qkv_b = torch.cat(
            [layer["self_attn.q_proj.bias"].view(ng, hpg, hd),
             layer["self_attn.k_proj.bias"].view(ng, 1, hd),
             layer["self_attn.v_proj.bias"].view(ng, 1, hd)], dim=1,
        ).reshape(-1)
    _expect(layer["mlp.gate_proj.weight"], (cfg.intermediate_size, h), "gate_proj.weight")
    _expect(layer["mlp.up_proj.weight"], (cfg.intermediate_size, h), "up_proj.weight")
    gates = layer["mlp.gate_proj.weight"].chunk(tp, dim=0)
    ups = layer["mlp.up_proj.weight"].chunk(tp, dim=0)
    shards = []
    for r in range(tp):
        shard: StateDict = {
            "input_layernorm.weight": layer["input_layernorm.weight"].clone(),
            "pre_mlp_layernorm.weight": layer["post_attention_layernorm.weight"].clone(),
            "self_attention.linear_qkv.weight": qkv.chunk(tp, dim=0)[r].clone(),
            "self_attention.linear_proj.weight": layer["self_attn.o_proj.weight"].chunk(tp, dim=1)[r].clone(),
            "mlp.linear_fc1.weight": torch.cat([gates[r], ups[r]], dim=0),
            "mlp.linear_fc2.weight": layer["mlp.down_proj.weight"].chunk(tp, dim=1)[r].clone(),
        }
        if qkv_b is not None:
            shard["self_attention.linear_qkv.bias"] = qkv_b.chunk(tp, dim=0)[r].clone()
        shards.append(shard)
    return shards


# ---- vocab-parallel tensors ------------------------------------------------------

def unpad_vocab(tp_shards: Sequence[Tensor], vocab_size: int, what: str) -> Tensor:
    full = torch.cat(list(tp_shards), dim=0)
    if full.shape[0] < vocab_size:
        raise ValueError(f"{what}: {full.shape[0]} vocab rows < vocab_size={vocab_size}")
    return full[:vocab_size]


def pad_and_split_vocab(weight: Tensor, padded_vocab: int, tp: int) -> list[Tensor]:
    """Pad rows with zeros up to Megatron's padded vocab, then split evenly over TP."""
    if padded_vocab < weight.shape[0] or padded_vocab % tp:
        raise ValueError(f"padded vocab {padded_vocab} must be >= {weight.shape[0]} and divisible by tp={tp}")
    padded = torch.zeros((padded_vocab, *weight.shape[1:]), dtype=weight.dtype)
    padded[: weight.shape[0]] = weight
    return [c.clone() for c in padded.chunk(tp, dim=0)]


# ---- whole model ------------------------------------------------------------------

def split_layer_keys(shard: Mapping[str, Tensor]) -> tuple[dict[int, StateDict], StateDict]:
    """Group a shard's keys into {local layer: layer-local dict} and the rest; drop _extra_state."""
    layers: dict[int, StateDict] = {}
    rest: StateDict = {}
    for key, value in shard.items():
        if key.endswith("_extra_state"):
            continue
        m = _LAYER_RE.match(key)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = value
        else:
            rest[key] = value
    return layers, rest


def megatron_to_canonical(
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]], cfg: LMConfig, layout: ParallelLayout
) -> StateDict:
    """``{(pp_rank, tp_rank): shard}`` for every rank -> canonical state dict."""
    expected = {(p, t) for p in range(layout.pp) for t in range(layout.tp)}
    if set(shards) != expected:
        raise ValueError(f"megatron_to_canonical: need shards for every (pp, tp) in {sorted(expected)}, "
                         f"got {sorted(shards)}")
    counts = layout.stage_layer_counts(cfg.num_layers)
    offsets = layout.stage_layer_offsets(cfg.num_layers)
    out: StateDict = {}
    split = {k: split_layer_keys(v) for k, v in shards.items()}
    for p in range(layout.pp):
        stage_layers = [split[(p, t)][0] for t in range(layout.tp)]
        if sorted(stage_layers[0]) != list(range(counts[p])):
            raise ValueError(f"pipeline stage {p}: expected local layers 0..{counts[p] - 1}, "
                             f"found {sorted(stage_layers[0])}")
        for local in range(counts[p]):
            layer = megatron_layer_to_canonical([sl[local] for sl in stage_layers], cfg)
            for name, value in layer.items():
                out[f"model.layers.{offsets[p] + local}.{name}"] = value
    out.update(megatron_to_canonical_ends({k: v[1] for k, v in split.items()}, cfg, layout))
    return out


def megatron_to_canonical_ends(rest: Mapping[tuple[int, int], Mapping[str, Tensor]], cfg: LMConfig,
                               layout: ParallelLayout) -> StateDict:
    """The non-layer tensors (embedding, final norm, output layer) from every rank's non-layer keys."""
    first = [rest[(0, t)] for t in range(layout.tp)]
    last = [rest[(layout.pp - 1, t)] for t in range(layout.tp)]
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(
        [r["embedding.word_embeddings.weight"] for r in first], cfg.vocab_size, "embedding.word_embeddings.weight")}
    out["model.norm.weight"] = last[0]["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = unpad_vocab([r["output_layer.weight"] for r in last], cfg.vocab_size,
                                            "output_layer.weight")
    return out


def canonical_to_megatron(
    canonical: Mapping[str, Tensor], cfg: LMConfig, layout: ParallelLayout
) -> dict[tuple[int, int], StateDict]:
    """Canonical state dict -> ``{(pp_rank, tp_rank): shard}`` (no ``_extra_state`` entries)."""
    tp = layout.tp
    check_tp(cfg, tp)
    counts = layout.stage_layer_counts(cfg.num_layers)
    offsets = layout.stage_layer_offsets(cfg.num_layers)
    padded = layout.padded_vocab_size(cfg.vocab_size)
    out: dict[tuple[int, int], StateDict] = {(p, t): {} for p in range(layout.pp) for t in range(tp)}
    for p in range(layout.pp):
        for local in range(counts[p]):
            prefix = f"model.layers.{offsets[p] + local}."
            layer = {k[len(prefix):]: v for k, v in canonical.items() if k.startswith(prefix)}
            if not layer:
                raise ValueError(f"canonical state dict has no tensors for layer {offsets[p] + local}")
            for t, shard in enumerate(canonical_layer_to_megatron(layer, cfg, tp)):
                out[(p, t)].update({f"decoder.layers.{local}.{k}": v for k, v in shard.items()})
    embed = canonical["model.embed_tokens.weight"]
    _expect(embed, (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")
    for t, part in enumerate(pad_and_split_vocab(embed, padded, tp)):
        out[(0, t)]["embedding.word_embeddings.weight"] = part
    last = layout.pp - 1
    head = embed if cfg.tie_word_embeddings else canonical["lm_head.weight"]
    _expect(head, (cfg.vocab_size, cfg.hidden_size), "lm_head.weight")
    # With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as
    # output_layer.weight (Megatron all-reduces their grads); with PP == 1 there is no copy.
    if not cfg.tie_word_embeddings or layout.pp > 1:
        for t, part in enumerate(pad_and_split_vocab(head, padded, tp)):
            out[(last, t)]["output_layer.weight"] = part
    for t in range(tp):
        out[(last, t)]["decoder.final_layernorm.weight"] = canonical["model.norm.weight"].clone()
    return out
