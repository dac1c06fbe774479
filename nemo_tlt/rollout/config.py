"""The ``rollout:`` block: which engine decodes, and (inherited) whether and how it speculates."""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.adaptive.config import SpecDecodingConfig

ENGINES = ("torch", "trtllm")


@dataclass(frozen=True)
class RolloutConfig(SpecDecodingConfig):
    """``engine``: the rollout engine (``torch``: the embedded engine, the default and the
    oracle; ``trtllm``: TensorRT-LLM's LLM API, the ``trtllm`` extra, see
    ``rollout.trtllm_engine``); the SD fields are :class:`~nemo_tlt.adaptive.config.SpecDecodingConfig`'s."""

    engine: str = "torch"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine not in ENGINES:
            raise ValueError(f"RolloutConfig.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
