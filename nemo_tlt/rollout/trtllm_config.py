"""`TRTLLMEngineConfig`: what the TensorRT-LLM rollout engine is built from, and the
keyword arguments it hands to TensorRT-LLM's LLM API (pure; no TensorRT-LLM needed).

The LLM API followed is TensorRT-LLM at the commit named by ``TRTLLM_SOURCE``
(``tensorrt_llm/llmapi/llm_args.py``: ``Eagle3DecodingConfig``, ``max_concurrency``,
``draft_len_schedule``, ``use_rejection_sampling``, ``orchestrator_type``,
``ray_worker_extension_cls``, ``load_format``; ``tensorrt_llm/llmapi/rlhf_utils.py``:
``WorkerExtension.update_weights``). Field names move between releases: another
version may need these mappings changed (docs/trtllm.md).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from nemo_tlt.checks import check_int

TRTLLM_PACKAGE = "tensorrt_llm"
TRTLLM_SOURCE = "NVIDIA/TensorRT-LLM@0004396720054fd8e205cbf616f21f0b57c6b412"
# The release line carrying that commit's API (draft_len_schedule on the one-model path landed on
# main in March 2026, after 1.2.1): pyproject.toml's ``trtllm`` extra pins the same range.
TRTLLM_REQUIREMENT = "tensorrt_llm>=1.3.0rc0,<1.4"
TRTLLM_INSTALL = "pip install nemo-tlt[trtllm]"
# Our subclass of TensorRT-LLM's rlhf WorkerExtension (imported by TensorRT-LLM's Ray workers only).
WORKER_EXTENSION = "nemo_tlt.rollout.trtllm_worker.TLTWorkerExtension"
LOAD_FORMATS = ("auto", "dummy")


def tensorrt_llm_installed() -> bool:
    """Whether the ``tensorrt_llm`` package can be found, without importing it (importing it
    starts CUDA and MPI: seconds, and a GPU)."""
    return importlib.util.find_spec(TRTLLM_PACKAGE) is not None


def missing_package_message(what: str) -> str:
    """What to do when ``what`` needs TensorRT-LLM and the package is absent."""
    return (f"{what} needs NVIDIA TensorRT-LLM (the {TRTLLM_PACKAGE!r} package), which is not installed here. "
            f"Install the extra: `{TRTLLM_INSTALL}` ({TRTLLM_REQUIREMENT}; NVIDIA's wheels run on Linux hosts "
            "with an NVIDIA GPU, see docs/trtllm.md), or use the embedded engine (rollout.engine=torch)")


@dataclass(frozen=True)
class TRTLLMEngineConfig:
    """The TensorRT-LLM engine's build-time settings.

    ``target_dir``: the HF-format policy folder (config.json; weights unless
    ``load_format='dummy'``, TensorRT-LLM's RL setting: random weights until the first
    refit). ``drafter_dir``: an EAGLE-3 HF-layout drafter folder (``nemo-tlt convert
    --from drafter --to eagle3-hf``); None builds the LLM without speculation.
    ``max_draft_len`` sizes TensorRT-LLM's draft buffers; tree shapes deeper than it
    are clipped. ``eagle3_layers_to_capture`` None is TensorRT-LLM's default
    {1, L//2-1, L-4}. ``use_rejection_sampling`` is TensorRT-LLM's prototype flag
    (see trtllm_engine's lossless statement). ``max_concurrency`` is the schedule the
    LLM is built with (SD off above it; None: always on). ``runtime_schedule``: install
    the SD policy's schedule before each rollout through our worker extension
    (an undocumented path, unverified); False keeps the build-time schedule and
    refuses a policy whose schedule differs. ``weight_bucket_mb`` bounds the tensors
    per refit call; ``drafter_weight_prefix`` names the draft module inside the
    one-model target for the unverified drafter refit.
    """

    target_dir: str
    drafter_dir: Optional[str] = None
    max_draft_len: int = 4
    eagle3_layers_to_capture: Optional[Tuple[int, ...]] = None
    use_dynamic_tree: bool = False
    dynamic_tree_max_topk: Optional[int] = None
    use_rejection_sampling: bool = False
    max_concurrency: Optional[int] = None
    tensor_parallel_size: int = 1
    max_batch_size: int = 256
    load_format: str = "auto"
    runtime_schedule: bool = True
    weight_bucket_mb: int = 512
    drafter_weight_prefix: str = "draft_model."

    def __post_init__(self) -> None:
        if not isinstance(self.target_dir, str) or not self.target_dir:
            raise ValueError(f"TRTLLMEngineConfig.target_dir must be a non-empty path, got {self.target_dir!r}")
        if self.drafter_dir is not None and (not isinstance(self.drafter_dir, str) or not self.drafter_dir):
            raise ValueError(f"TRTLLMEngineConfig.drafter_dir must be a path or null, got {self.drafter_dir!r}")
        check_int("TRTLLMEngineConfig.max_draft_len", self.max_draft_len, 1)
        check_int("TRTLLMEngineConfig.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("TRTLLMEngineConfig.max_batch_size", self.max_batch_size, 1)
        check_int("TRTLLMEngineConfig.weight_bucket_mb", self.weight_bucket_mb, 1)
        if self.max_concurrency is not None:
            check_int("TRTLLMEngineConfig.max_concurrency", self.max_concurrency, 1)
        if self.eagle3_layers_to_capture is not None:
            layers = tuple(self.eagle3_layers_to_capture)
            for i, layer in enumerate(layers):
                check_int(f"TRTLLMEngineConfig.eagle3_layers_to_capture[{i}]", layer, 0)
            if len(set(layers)) != len(layers) or not layers:
                raise ValueError("TRTLLMEngineConfig.eagle3_layers_to_capture must list distinct layer indices, "
                                 f"got {list(layers)}")
            object.__setattr__(self, "eagle3_layers_to_capture", layers)
        if self.use_dynamic_tree:
            check_int("TRTLLMEngineConfig.dynamic_tree_max_topk", self.dynamic_tree_max_topk, 1)
        elif self.dynamic_tree_max_topk is not None:
            raise ValueError("TRTLLMEngineConfig.dynamic_tree_max_topk is only read with use_dynamic_tree: true")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"TRTLLMEngineConfig.load_format must be one of {list(LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        for name in ("use_dynamic_tree", "use_rejection_sampling", "runtime_schedule"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TRTLLMEngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.drafter_dir is None and self.max_concurrency is not None:
            raise ValueError("TRTLLMEngineConfig.max_concurrency needs a drafter_dir (no drafter: no speculation)")

    def speculative_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments of ``tensorrt_llm.llmapi.Eagle3DecodingConfig`` (None: no drafter)."""
        if self.drafter_dir is None:
            return None
        kwargs: dict[str, Any] = {"max_draft_len": self.max_draft_len, "speculative_model": self.drafter_dir,
                                  "eagle3_one_model": True, "use_rejection_sampling": self.use_rejection_sampling}
        if self.eagle3_layers_to_capture is not None:
            kwargs["eagle3_layers_to_capture"] = set(self.eagle3_layers_to_capture)
        if self.use_dynamic_tree:
            kwargs.update(use_dynamic_tree=True, dynamic_tree_max_topK=self.dynamic_tree_max_topk)
        if self.max_concurrency is not None:
            kwargs["max_concurrency"] = self.max_concurrency
        return kwargs

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``tensorrt_llm.LLM`` other than ``speculative_config``:
        Ray orchestration with our worker extension (weight refit), token ids in and out."""
        return {"model": self.target_dir, "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": 1, "max_batch_size": self.max_batch_size,
                "orchestrator_type": "ray", "ray_worker_extension_cls": WORKER_EXTENSION,
                "load_format": self.load_format, "skip_tokenizer_init": True}

    def build_schedule(self) -> dict[int, int]:
        """The draft_len_schedule the LLM starts with (TensorRT-LLM's reading of
        ``max_concurrency``; ``{}``: no drafter, no speculation)."""
        if self.drafter_dir is None:
            return {}
        return {self.max_concurrency or self.max_batch_size: self.max_draft_len}
