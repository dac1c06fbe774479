"""Build a real megatron-core ``GPTModel`` that matches an ``LMConfig``.

Contract: ``build_gpt_model(cfg, layout)`` returns this rank's GPTModel (its TP
shard of its PP stage) for a Llama / Qwen2 family config: RMSNorm, SwiGLU,
rotary position embeddings with ``rope_theta`` (and Llama-3.1 ``llama3`` scaling
through megatron-core's ``rope_scaling`` / ``rope_scaling_factor``), GQA through
``num_query_groups``, Qwen2's q/k/v biases through ``add_qkv_bias``, tied or
untied output layer, vocabulary padded as Megatron pads it. A config megatron-core
cannot reproduce exactly is refused with a ValueError naming the field
(``check_megatron_model``), never built approximately. ``use_cpu_initialization=True``
so the same call works under gloo on CPU (with ``megatron_patches.cpu_shims``) and
under NCCL on GPUs.

``Training`` carries what a policy trainer adds to the config: sequence parallelism,
activation recompute (``none``: keep activations; ``full``: recompute every decoder
layer in backward, megatron's ``recompute_granularity="full"``, uniform, one layer per
chunk; ``selective``: recompute only the core attention) and ``per_token_loss``
(megatron's ``calculate_per_token_loss``: gradients summed over data-parallel replicas).
The layer spec is Transformer Engine's (``get_gpt_layer_with_transformer_engine_spec``:
fused kernels, flash attention) where ``transformer_engine`` is importable and the
model is on a GPU, megatron's local spec otherwise (``layer_spec_name`` says which; the
policy logs it). Both compute the same layer; the local one is what runs here.

``init_model_parallel`` must have been called with ``layout.tp`` / ``layout.pp``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import check_megatron_biases

# megatron-core 0.16's llama3 scaling (RotaryEmbedding._apply_scaling) takes only `factor`
# from GPTModel (rope_scaling_factor); these three stay at its defaults, Llama-3.1's values.
_MCORE_LLAMA3_FIXED = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _mcore_llama3_defaults() -> dict[str, float]:
    """The values megatron-core's llama3 rope scaling always uses for _MCORE_LLAMA3_FIXED,
    read from the installed version rather than assumed."""
    import inspect

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    return {name: params[name].default for name in _MCORE_LLAMA3_FIXED}


def check_megatron_model(cfg: LMConfig) -> None:
    """Raise a ValueError naming the field when megatron-core's GPTModel cannot compute
    exactly what `cfg` (and so the reference DecoderLM) computes."""
    check_megatron_biases(cfg)
    if cfg.rope_scaling is None:
        return
    fixed = _mcore_llama3_defaults()
    for name, value in fixed.items():
        got = getattr(cfg.rope_scaling, name)
        if got != value:
            raise ValueError(
                f"LMConfig.rope_scaling.{name}={got!r} is not supported by megatron-core's llama3 rope scaling, "
                f"which fixes {', '.join(f'{k}={v}' for k, v in fixed.items())} (Llama-3.1's values) and takes "
                "only `factor`")


def rope_kwargs(cfg: LMConfig) -> dict:
    """GPTModel's rotary keyword arguments for `cfg` (after check_megatron_model)."""
    kwargs = {"rotary_base": int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta}
    if cfg.rope_scaling is None:
        return {**kwargs, "rope_scaling": False}
    return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(cfg.rope_scaling.factor)}


RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class Training:
    """Trainer-side TransformerConfig settings (see the module docstring); the default is inference."""

    sequence_parallel: bool = False
    recompute: str = "none"
    per_token_loss: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")


def _recompute_kwargs(recompute: str) -> dict:
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def layer_spec_name(device_type: str = "cuda") -> str:
    """``transformer_engine`` where it is importable and the model runs on a GPU, else ``local``."""
    return "transformer_engine" if device_type == "cuda" and importlib.util.find_spec("transformer_engine") else "local"


def transformer_config(cfg: LMConfig, layout: ParallelLayout, *, dtype: torch.dtype = torch.float32,
                       training: Training = Training(), initialize: bool = True):
    """The megatron ``TransformerConfig`` equivalent of ``cfg`` under ``layout``; ``initialize=False``
    leaves the weights uninitialised (``perform_initialization``) for a caller that loads every one."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_megatron_model(cfg)
    if training.sequence_parallel and layout.tp == 1:
        raise ValueError("sequence parallelism needs tensor_parallel > 1 (it splits the sequence over TP ranks)")
    layout.stage_layer_counts(cfg.num_layers)  # fail early with our message, not megatron's assert
    if cfg.num_kv_heads % layout.tp:
        raise ValueError(
            f"TP={layout.tp} does not divide num_kv_heads={cfg.num_kv_heads} (query groups are split whole)"
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(cfg.qkv_bias),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        num_layers_in_first_pipeline_stage=layout.num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=layout.num_layers_in_last_stage,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # Megatron's fused softmax / bias kernels need CUDA; the plain ones are exact references.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=training.sequence_parallel,
        calculate_per_token_loss=training.per_token_loss,
        **_recompute_kwargs(training.recompute),
    )


def build_gpt_model(
    cfg: LMConfig, layout: ParallelLayout, *, dtype: torch.dtype = torch.float32, vp_stage: int | None = None,
    padded_vocab_size: int | None = None, training: Training = Training(), spec: str = "local",
    initialize: bool = True,
):
    """This rank's ``GPTModel`` (pre/post process decided by its PP stage).

    ``initialize=False`` skips megatron's random initialisation: the weights are allocated
    (untouched memory) for a caller that loads every one of them next. With
    ``use_cpu_initialization`` megatron initialises each TP-split weight by building the
    whole (all-TP) tensor first, which a loader that never holds a full tensor must avoid.

    ``padded_vocab_size`` overrides Megatron's padding rule, e.g. to load a checkpoint
    that was written at another TP size (its padding is baked into the tensors). ``spec``
    is ``local`` or ``transformer_engine`` (``layer_spec_name``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    if padded_vocab_size is not None and (padded_vocab_size < cfg.vocab_size or padded_vocab_size % layout.tp):
        raise ValueError(f"padded_vocab_size={padded_vocab_size} must be >= vocab_size={cfg.vocab_size} "
                         f"and divisible by tp={layout.tp}")
    tconf = transformer_config(cfg, layout, dtype=dtype, training=training, initialize=initialize)
    if spec == "transformer_engine":
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    elif spec == "local":
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        raise ValueError(f"spec must be 'local' or 'transformer_engine', got {spec!r}")
    model = GPTModel(
        config=tconf,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size or layout.padded_vocab_size(cfg.vocab_size),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        **rope_kwargs(cfg),
        parallel_output=True,
        vp_stage=vp_stage,
    )
    if not initialize:
        mark_tensor_parallel(model, tconf)
    # torch-norm layers ignore params_dtype; Megatron's Float16Module casts the whole model the
    # same way in bf16 / fp16 training, so every weight ends up in one dtype.
    return model.to(dtype) if dtype != torch.float32 else model


def mark_tensor_parallel(model: torch.nn.Module, tconf) -> None:
    """Give the TP-split weights of an uninitialised model the attributes megatron's initialisation
    sets (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``).

    megatron-core 0.16 sets them only inside its weight initialisers, so without
    ``perform_initialization`` the grad-norm and checkpoint code would take every TP shard for
    a replica. The rules are those of its layers: column-parallel linears and the vocab-parallel
    embedding split dim 0 (stride 2 for a gated MLP's ``linear_fc1``, which interleaves
    [gate, up] per rank), row-parallel linears dim 1. Tested against an initialised build.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            gated_fc1 = name.endswith("linear_fc1") and tconf.gated_linear_unit
            set_tensor_model_parallel_attributes(weight, True, 0, 2 if gated_fc1 else 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
