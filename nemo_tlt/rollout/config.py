"""The ``rollout:`` block: which engine decodes, in which arithmetic, and (inherited)
whether and how it speculates."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.checks import check_int

ENGINES = ("torch", "trtllm")
COMPUTE_DTYPES = {"model": None, "float32": torch.float32}


@dataclass(frozen=True)
class RolloutConfig(SpecDecodingConfig):
    """``engine``: the rollout engine (``torch``: the embedded engine, the default and the
    oracle; ``trtllm``: TensorRT-LLM's LLM API, the ``trtllm`` extra, see
    ``rollout.trtllm_engine``). ``compute_dtype``: the arithmetic of the engine's target (prefill, plain
    decode, verification, KV cache): ``model`` follows ``model.dtype``; ``float32`` serves
    ``model.dtype`` weights (bf16-rounded when bf16) computed in fp32, at the price of an
    fp32 copy of the weights, an fp32 KV cache and fp32 math, so that speculative and plain
    decoding give the same tokens in bf16 as they do in fp32 (measured:
    docs/benchmarks.md, "Precision"). ``tensor_parallel``: ranks per rollout replica (torch
    engine): the loop groups consecutive ranks into replicas of this many, each rank holding
    1/TP of the model's split weights (``nemo_tlt.weights.rollout``); every rank of a replica
    decodes the replica's prompts together. The SD fields are
    :class:`~nemo_tlt.adaptive.config.SpecDecodingConfig`'s."""

    engine: str = "torch"
    compute_dtype: str = "model"
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("rollout.tensor_parallel", self.tensor_parallel, 1)
        if self.tensor_parallel > 1 and self.engine != "torch":
            raise ValueError(f"rollout.tensor_parallel={self.tensor_parallel} with rollout.engine={self.engine} is not "
                             "built (TensorRT-LLM places its own TP workers; the loop's replica ranks would have to "
                             "hand it their GPUs): use rollout.engine=torch or rollout.tensor_parallel=1")
        if self.engine not in ENGINES:
            raise ValueError(f"RolloutConfig.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"RolloutConfig.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got "
                             f"{self.compute_dtype!r}")

    @property
    def engine_compute_dtype(self) -> torch.dtype | None:
        """The engine's ``compute_dtype`` argument (None: the model's dtype)."""
        return COMPUTE_DTYPES[self.compute_dtype]
