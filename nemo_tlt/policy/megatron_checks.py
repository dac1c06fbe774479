"""The megatron policy's layout and the checks made before any collective (a bad TP / PP or
spec fails alike on every rank, naming the field)."""
from __future__ import annotations

import hashlib
from typing import Sequence

from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.batching import Sequence2
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import check_tp

VOCAB_MULTIPLE = 128  # Megatron's default make_vocab_size_divisible_by


def policy_layout(config: PolicyConfig) -> ParallelLayout:
    return ParallelLayout(tp=config.tensor_parallel, pp=config.pipeline_parallel,
                          make_vocab_size_divisible_by=VOCAB_MULTIPLE)


def check_policy_model(config: PolicyConfig, model_config: LMConfig) -> None:
    """Refuse a TP that cannot split heads / query groups / MLP, or a PP the layers cannot fill."""
    try:
        check_tp(model_config, config.tensor_parallel)
    except ValueError as err:
        raise ValueError(f"policy.tensor_parallel={config.tensor_parallel}: {err}") from None
    if config.pipeline_parallel > model_config.num_layers:
        raise ValueError(f"policy.pipeline_parallel={config.pipeline_parallel} exceeds num_layers="
                         f"{model_config.num_layers}: every stage needs at least one layer")
    try:
        policy_layout(config).stage_layer_counts(model_config.num_layers)
    except ValueError as err:
        raise ValueError(f"policy.pipeline_parallel={config.pipeline_parallel}: {err}") from None


def check_policy_spec(config: PolicyConfig, spec: str, device_type: str) -> None:
    """Refuse sequence parallelism where megatron-core's local layer spec would be built: its norm
    (``WrappedTorchNorm``, apex absent) asserts ``sequence_parallel`` is off."""
    if config.sequence_parallel and spec == "local":
        raise ValueError("policy.sequence_parallel=true needs Transformer Engine's layer spec (transformer_engine "
                         f"installed, the policy on a GPU); on this {device_type} rank megatron-core's local spec "
                         "would be built, whose norm (WrappedTorchNorm) does not support sequence parallelism")


def batch_digest(batch: Sequence[Sequence2]) -> str:
    return hashlib.sha256(repr([(list(p), list(r)) for p, r in batch]).encode()).hexdigest()
