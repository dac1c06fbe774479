"""What a `nemo-tlt train` run on the TensorRT-LLM engine can and cannot ask for, checked
before any work (pure: nothing is imported or loaded).

`nemo-tlt train` with ``rollout.engine=trtllm`` stops with exit 2 when TensorRT-LLM is not
installed (the message names the extra), and names each setting the engine cannot
express, so that no model is loaded for a run that would fail at its first rollout:

* ``grpo.acceptance=coupled``: TensorRT-LLM's sampler draws from a per-request random
  stream, not noise keyed by (seed, sequence, position); see ``trtllm_engine``.
* TLT mode (``rollout.sd_enabled`` or ``drafter.train_on_idle``): the RL loop hands the
  engine torch drafter modules and retrains them between steps; TensorRT-LLM drafts
  with an EAGLE-3 HF folder fixed when the LLM is built (runtime drafter refit is not a
  documented API), and per-step tree choice does not reach it (only a draft-length
  schedule by batch size, ``trtllm_schedule``). The NeMo adapters, which take a drafter
  folder (``tlt.trtllm.drafter_dir``), run TLT's schedule on TensorRT-LLM.
* ``drafter.harvest_from=rollout``: the LLM API returns no hidden states.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.rollout.trtllm_config import missing_package_message, tensorrt_llm_installed


@dataclass(frozen=True)
class TrainRunAsks:
    """The settings of a training run that the TensorRT-LLM engine is checked against."""

    acceptance: str           # grpo.acceptance
    sd_enabled: bool          # rollout.sd_enabled
    train_on_idle: bool       # drafter.train_on_idle
    harvest_from: str         # drafter.harvest_from


def unsupported_settings(asks: TrainRunAsks) -> list[str]:
    """One line per setting TensorRT-LLM cannot express, naming the key and the reason."""
    lines = []
    if asks.acceptance == "coupled":
        lines.append("grpo.acceptance=coupled: not expressible (TensorRT-LLM samples from a per-request random "
                     "stream, so SD would not reproduce plain decoding's tokens); use greedy or rejection")
    if asks.sd_enabled or asks.train_on_idle:
        lines.append("rollout.sd_enabled / drafter.train_on_idle (TLT mode): the RL loop loads and retrains torch "
                     "drafter modules, while TensorRT-LLM drafts with an EAGLE-3 folder fixed at build time and "
                     "takes no per-step tree choice; run the baseline (rollout.sd_enabled=false "
                     "drafter.train_on_idle=false) or the NeMo adapters with tlt.trtllm.drafter_dir")
    if asks.train_on_idle and asks.harvest_from == "rollout":
        lines.append("drafter.harvest_from=rollout: TensorRT-LLM's LLM API returns no hidden states; "
                     "use drafter.harvest_from=policy")
    return lines


def train_run_refusal(asks: TrainRunAsks) -> str | None:
    """The message a ``rollout.engine=trtllm`` run stops with (None: it can go on)."""
    unsupported = unsupported_settings(asks)
    parts = []
    if not tensorrt_llm_installed():
        parts.append(missing_package_message("rollout.engine=trtllm"))
    if unsupported:
        parts.append("rollout.engine=trtllm cannot run what this config asks for:\n"
                     + "\n".join(f"  - {line}" for line in unsupported))
    return "\n".join(parts) or None
