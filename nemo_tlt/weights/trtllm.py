"""Canonical weights -> a TensorRT-LLM checkpoint folder (Llama / Qwen2 families).

Contract: ``canonical_to_trtllm(canonical, cfg, tp)`` returns the TensorRT-LLM
``config.json`` dict and one state dict per TP rank, named as TensorRT-LLM's
own Llama / Qwen converters name them:

===========================================  ==========================================  ==========
TensorRT-LLM name                            canonical (HF) source                       TP split
===========================================  ==========================================  ==========
transformer.vocab_embedding.weight           model.embed_tokens.weight                   replicated
transformer.layers.{i}.input_layernorm       model.layers.{i}.input_layernorm            replicated
transformer.layers.{i}.attention.qkv         cat(q_r, k_r, v_r) of q/k/v_proj (+ bias)    rows, per rank
transformer.layers.{i}.attention.dense       self_attn.o_proj                            columns
transformer.layers.{i}.post_layernorm        post_attention_layernorm                    replicated
transformer.layers.{i}.mlp.fc                mlp.gate_proj (the SiLU-activated branch)   rows
transformer.layers.{i}.mlp.gate              mlp.up_proj                                 rows
transformer.layers.{i}.mlp.proj              mlp.down_proj                               columns
transformer.ln_f.weight                      model.norm.weight                           replicated
lm_head.weight                               lm_head (embedding when tied), vocab padded  rows
===========================================  ==========================================  ==========

The fc/gate assignment (HF ``up_proj`` -> TRT ``mlp.gate``, ``gate_proj`` ->
``mlp.fc``) follows TensorRT-LLM's published Llama converter. A Llama with
``attention_bias`` also gets ``attention.dense.bias`` (HF o_proj.bias, whole on
every rank: TensorRT-LLM adds a row-parallel bias once, after the all-reduce).
``write_trtllm_checkpoint`` writes ``config.json`` + ``rank{N}.safetensors``.

``config.json`` fields, as TensorRT-LLM's ``PretrainedConfig`` /
``LLaMAConfig`` / ``QWenConfig`` read them (TensorRT-LLM 1.0 line, source read at
``tensorrt_llm/models/modeling_utils.py``, ``models/llama/config.py``,
``models/qwen/config.py`` and ``models/qwen/model.py``): ``architecture`` is the HF
class name (``MODEL_MAP`` sends ``Qwen2ForCausalLM`` to ``QWenForCausalLM``);
``qwen_type`` (``"qwen2"`` here) is read by ``QWenDecoderLayer``, which has no
default for it and halves ``intermediate_size`` for ``"qwen"`` (Qwen-1);
``attn_bias`` covers q/k/v (and, for Llama, the output projection);
``rotary_base`` / ``rotary_scaling`` are HF's ``rope_theta`` / ``rope_scaling``;
``mapping`` becomes a ``Mapping``. Other keys in the file would only become
stray attributes, so none are written.

Only names, shapes, splits and these config values are tested here; TensorRT-LLM
itself does not install on CPU machines, so that it loads this folder is NOT
tested in this repository.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from nemo_tlt.model.config import LMConfig
from nemo_tlt.atomic import atomic_output_dir
from nemo_tlt.weights.rollout import check_rollout_tp

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def trtllm_config(cfg: LMConfig, tp: int, dtype: torch.dtype) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.family]
    config: dict[str, Any] = {
        "architecture": arch,
        "dtype": _DTYPE_NAMES[dtype],
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_size": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.rope_theta,
        # TensorRT-LLM's converters pass HF's rope_scaling dict through as is; HF omits the
        # key (None here) when the rotary frequencies are not scaled.
        "rotary_scaling": cfg.to_hf_config().get("rope_scaling"),
        "attn_bias": bool(cfg.qkv_bias),
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_parallel_embedding": False,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
    }
    if cfg.family == "qwen2":
        config["qwen_type"] = "qwen2"
    return config


def _rank_layer(canonical: Mapping[str, torch.Tensor], i: int, cfg: LMConfig, tp: int, r: int) -> dict:
    src, dst = f"model.layers.{i}.", f"transformer.layers.{i}."

    def rows(name: str) -> torch.Tensor:
        return canonical[src + name].chunk(tp, dim=0)[r]

    def cols(name: str) -> torch.Tensor:
        return canonical[src + name].chunk(tp, dim=1)[r]

    out = {
        dst + "input_layernorm.weight": canonical[src + "input_layernorm.weight"],
        dst + "post_layernorm.weight": canonical[src + "post_attention_layernorm.weight"],
        # TensorRT-LLM fuses q, k, v per rank: this rank's heads of q, then of k, then of v.
        dst + "attention.qkv.weight": torch.cat([rows(f"self_attn.{p}_proj.weight") for p in "qkv"], dim=0),
        dst + "attention.dense.weight": cols("self_attn.o_proj.weight"),
        dst + "mlp.fc.weight": rows("mlp.gate_proj.weight"),
        dst + "mlp.gate.weight": rows("mlp.up_proj.weight"),
        dst + "mlp.proj.weight": cols("mlp.down_proj.weight"),
    }
    if cfg.qkv_bias:
        out[dst + "attention.qkv.bias"] = torch.cat([rows(f"self_attn.{p}_proj.bias") for p in "qkv"], dim=0)
    if cfg.family == "llama" and cfg.qkv_bias:
        # TensorRT-LLM's Llama attention gives the dense layer a bias whenever attn_bias is set.
        if src + "self_attn.o_proj.bias" not in canonical:
            raise ValueError(f"{src}self_attn.o_proj.bias is missing: TensorRT-LLM's Llama attn_bias=true "
                             "needs the output projection's bias too (HF attention_bias covers q/k/v and o)")
        out[dst + "attention.dense.bias"] = canonical[src + "self_attn.o_proj.bias"]
    return out


def canonical_to_trtllm(canonical: Mapping[str, torch.Tensor], cfg: LMConfig,
                        tp: int) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    check_rollout_tp(cfg, tp)
    embed = canonical["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else canonical["lm_head.weight"]
    # TensorRT-LLM pads the lm_head's vocab rows to a multiple of tp before splitting.
    padded = -(-cfg.vocab_size // tp) * tp
    head_padded = torch.zeros((padded, head.shape[1]), dtype=head.dtype)
    head_padded[: cfg.vocab_size] = head
    ranks = []
    for r in range(tp):
        sd: dict[str, torch.Tensor] = {"transformer.vocab_embedding.weight": embed,
                                       "transformer.ln_f.weight": canonical["model.norm.weight"],
                                       "lm_head.weight": head_padded.chunk(tp, dim=0)[r]}
        for i in range(cfg.num_layers):
            sd.update(_rank_layer(canonical, i, cfg, tp, r))
        ranks.append({k: v.contiguous().clone() for k, v in sd.items()})
    return trtllm_config(cfg, tp, embed.dtype), ranks


def write_trtllm_checkpoint(canonical: Mapping[str, torch.Tensor], cfg: LMConfig, tp: int,
                            out_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        write_trtllm_files(*canonical_to_trtllm(canonical, cfg, tp), tmp)


def write_trtllm_files(config: dict[str, Any], ranks: list[dict[str, torch.Tensor]], folder: Path) -> None:
    """``config.json`` + ``rank{N}.safetensors`` into an existing folder."""
    with open(folder / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for r, sd in enumerate(tqdm(ranks, desc="trtllm ranks", unit="rank")):
        save_file(sd, str(folder / f"rank{r}.safetensors"))
