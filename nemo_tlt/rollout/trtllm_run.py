"""What a `nemo-tlt train` run on the TensorRT-LLM engine can and cannot ask for, checked
before any work (nothing is loaded, TensorRT-LLM is not imported).

`nemo-tlt train` with ``rollout.engine=trtllm`` stops with exit 2 when TensorRT-LLM is not
installed (the message names the extra), and names each setting the engine's declared
``LIMITS`` cannot run (``rollout.run_limits``), so that no model is loaded for a run that
would fail at its first rollout:

* ``grpo.acceptance=coupled``: TensorRT-LLM's sampler draws from a per-request random
  stream, not noise keyed by (seed, sequence, position); see ``trtllm_engine``.
* TLT mode (``rollout.sd_enabled`` or ``drafter.train_on_idle``): the RL loop hands the
  engine torch drafter modules and retrains them between steps; TensorRT-LLM drafts
  with an EAGLE-3 HF folder fixed when the LLM is built (runtime drafter refit is not a
  documented API), and per-step tree choice does not reach it (only a draft-length
  schedule by batch size, ``trtllm_schedule``). The NeMo adapters, which take a drafter
  folder (``tlt.trtllm.drafter_dir``), run TLT's schedule on TensorRT-LLM.
* ``drafter.harvest_from=rollout``: the LLM API returns no hidden states.
* ``rollout.trtllm.tensor_parallel_size > 1``: TensorRT-LLM would place its own TP workers on
  GPUs the loop's ranks already hold (the NeMo adapters run it).
"""
from __future__ import annotations

from nemo_tlt.rollout.config import TRTLLMRolloutSettings
from nemo_tlt.rollout.run_limits import TrainRunAsks, unsupported_settings
from nemo_tlt.rollout.trtllm_config import missing_package_message, tensorrt_llm_installed

__all__ = ["TrainRunAsks", "train_run_refusal"]


def train_run_refusal(asks: TrainRunAsks, settings: TRTLLMRolloutSettings = TRTLLMRolloutSettings()) -> str | None:
    """The message a ``rollout.engine=trtllm`` run stops with (None: it can go on): the missing
    package, and each setting the engine's declared ``LIMITS`` (or the run's ranks, for
    ``settings.tensor_parallel_size``) cannot run."""
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine  # its LIMITS; TensorRT-LLM is imported lazily

    unsupported = unsupported_settings("trtllm", TRTLLMRolloutEngine.LIMITS, asks)
    if settings.tensor_parallel_size > 1:
        unsupported.append(f"rollout.trtllm.tensor_parallel_size={settings.tensor_parallel_size} with nemo-tlt train: "
                           "TensorRT-LLM would place its own TP workers on GPUs the run's ranks hold; use 1 "
                           "(the NeMo adapters run TensorRT-LLM's TP)")
    parts = []
    if not tensorrt_llm_installed():
        parts.append(missing_package_message("rollout.engine=trtllm"))
    if unsupported:
        parts.append("rollout.engine=trtllm cannot run what this config asks for:\n"
                     + "\n".join(f"  - {line}" for line in unsupported))
    return "\n".join(parts) or None
