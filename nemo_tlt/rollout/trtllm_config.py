"""`TRTLLMEngineConfig`: what the TensorRT-LLM rollout engine is built from, and the
keyword arguments it hands to TensorRT-LLM's LLM API (pure; no TensorRT-LLM needed).

The LLM API followed is TensorRT-LLM's release ``TRTLLM_REQUIREMENT`` (tag commit
``TRTLLM_SOURCE``; ``tensorrt_llm/llmapi/llm_args.py``: ``Eagle3DecodingConfig``,
``max_concurrency``, ``draft_len_schedule``, ``use_rejection_sampling``, ``orchestrator_type``,
``ray_worker_extension_cls``, ``load_format``, ``allreduce_strategy``;
``tensorrt_llm/llmapi/rlhf_utils.py``: ``WorkerExtension.update_weights``). Each fact's own
source commit is in ``integrations/interface_facts.py`` and docs/trtllm.md (the tag's tree
itself was not readable here). Field names move between releases: another version may need
these mappings changed.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from nemo_tlt.checks import check_int

TRTLLM_PACKAGE = "tensorrt_llm"
# v1.3.0rc29's commit (the "Source Commit" of its PyPI sdist). draft_len_schedule on the one-model
# path landed in v1.3.0rc8 (PR #10860); rc29 is the newest 1.3 release. pyproject.toml's ``trtllm``
# extra pins the same release.
TRTLLM_SOURCE = "NVIDIA/TensorRT-LLM@c76f4a856447820aa1f994b053da7580d69b657d"
TRTLLM_REQUIREMENT = "tensorrt_llm==1.3.0rc29"
# PyPI's tensorrt_llm is a placeholder sdist that downloads the wheel from NVIDIA's index at
# install time (and fails on a host without an NVIDIA driver): the index is named on the command.
TRTLLM_INDEX = "https://pypi.nvidia.com/"
TRTLLM_INSTALL = f'pip install --extra-index-url {TRTLLM_INDEX} "nemo-tlt[trtllm]"'
# TensorRT-LLM's own rlhf WorkerExtension (update_weights), which our Ray workers load.
WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
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
    refit; refused with a drafter, whose weights TensorRT-LLM never reads under it).
    ``drafter_dir``: an EAGLE-3 HF-layout drafter folder (``nemo-tlt convert --from drafter
    --to eagle3-hf``); None builds the LLM without speculation. ``max_draft_len`` sizes
    TensorRT-LLM's draft buffers; tree shapes deeper than it are clipped.
    ``eagle3_layers_to_capture`` None is TensorRT-LLM's default {1, L//2-1, L-4}.
    ``use_rejection_sampling`` is TensorRT-LLM's prototype flag (see trtllm_engine's
    lossless statement). The schedule the LLM is built with (TensorRT-LLM captures its CUDA
    graphs for it at start-up; a change is a restart, ``TRTLLMRolloutEngine.restart``):
    ``draft_len_schedule`` (batch-size threshold -> draft length, upstream's rules: the
    smallest key maps to ``max_draft_len``, no length above it; `trtllm_schedule`), or
    ``max_concurrency`` (SD off above it), or neither (always on). ``weight_bucket_mb``
    bounds the tensors per refit call.
    """

    target_dir: str
    drafter_dir: Optional[str] = None
    max_draft_len: int = 4
    eagle3_layers_to_capture: Optional[Tuple[int, ...]] = None
    use_dynamic_tree: bool = False
    dynamic_tree_max_topk: Optional[int] = None
    use_rejection_sampling: bool = False
    max_concurrency: Optional[int] = None
    draft_len_schedule: Optional[Dict[int, int]] = None
    tensor_parallel_size: int = 1
    max_batch_size: int = 256
    load_format: str = "auto"
    weight_bucket_mb: int = 512

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
        for name in ("use_dynamic_tree", "use_rejection_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TRTLLMEngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.drafter_dir is None and self.max_concurrency is not None:
            raise ValueError("TRTLLMEngineConfig.max_concurrency needs a drafter_dir (no drafter: no speculation)")
        if self.draft_len_schedule is not None:
            if self.drafter_dir is None or self.max_concurrency is not None:
                raise ValueError("TRTLLMEngineConfig.draft_len_schedule needs a drafter_dir and excludes "
                                 "max_concurrency (TensorRT-LLM: mutually exclusive)")
            object.__setattr__(self, "draft_len_schedule", check_build_schedule(
                "TRTLLMEngineConfig.draft_len_schedule", self.draft_len_schedule, self.max_draft_len))
        if self.drafter_dir is not None and self.load_format == "dummy":
            raise ValueError("TRTLLMEngineConfig.load_format='dummy' with a drafter_dir: TensorRT-LLM's dummy load "
                             "randomises the drafter too and never reads its weights; use load_format='auto'")

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
        if self.draft_len_schedule is not None:
            kwargs["draft_len_schedule"] = dict(self.draft_len_schedule)
        return kwargs

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``tensorrt_llm.LLM`` other than ``speculative_config``:
        TensorRT-LLM's RL settings as its ``AsyncLLM`` forces them (Ray orchestration with the
        rlhf worker extension for weight refit, NCCL all-reduce), token ids in and out."""
        return {"model": self.target_dir, "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": 1, "max_batch_size": self.max_batch_size,
                "orchestrator_type": "ray", "ray_worker_extension_cls": WORKER_EXTENSION,
                "allreduce_strategy": "NCCL", "load_format": self.load_format, "skip_tokenizer_init": True}

    def build_schedule(self) -> dict[int, int]:
        """The draft_len_schedule the LLM starts with (TensorRT-LLM's reading of
        ``max_concurrency`` and ``draft_len_schedule``; ``{}``: no drafter, no speculation)."""
        if self.drafter_dir is None:
            return {}
        if self.draft_len_schedule is not None:
            return dict(self.draft_len_schedule)
        return {self.max_concurrency or self.max_batch_size: self.max_draft_len}


def check_build_schedule(field: str, schedule: Any, max_draft_len: int) -> dict[int, int]:
    """A ``draft_len_schedule`` as TensorRT-LLM validates it at build time, sorted: keys
    (batch sizes) >= 1, lengths >= 0, the smallest key's length ``max_draft_len``, none
    above it (ValueError naming ``field``)."""
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(f"{field} must be a non-empty mapping of batch size -> draft length, got {schedule!r}")
    for key, length in schedule.items():
        check_int(f"{field} key", key, 1)
        check_int(f"{field}[{key}]", length, 0)
    out = dict(sorted(schedule.items()))
    first = out[min(out)]
    if first != max_draft_len or max(out.values()) > max_draft_len:
        raise ValueError(f"{field}={out}: TensorRT-LLM wants the smallest batch size's length to be max_draft_len "
                         f"({max_draft_len}) and no length above it")
    return out
