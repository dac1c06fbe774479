"""Typed config of the policy backend (the ``policy:`` block of the top-level config).

Fields are OmegaConf-structured-config friendly (str / int / float / bool / Optional /
List / nested dataclasses, every one with a default) and validated at construction;
error messages name the YAML key (``policy.tensor_parallel``, ``policy.optim.lr``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.optim import OptimConfig
from nemo_tlt.registry import Registry

# policy.backend: a name here or an import path 'package.module:factory'. A factory is called as
# factory(config, canonical, model_config, temperature=, seed=, placement=) and returns a
# PolicyBackend (see nemo_tlt.policy.factory, whose built-in factories these are; docs/extending.md).
BACKENDS = Registry("policy backend", "policy.backend", {
    "torch": "nemo_tlt.policy.factory:torch_backend",
    "megatron": "nemo_tlt.policy.factory:megatron_backend",
})
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class PolicyOptimConfig(OptimConfig):
    """``OptimConfig`` under ``policy.optim`` (the default: constant LR 5e-5, betas 0.9 / 0.99)."""

    KEY: ClassVar[str] = "policy.optim"


@dataclass(frozen=True)
class PolicyConfig:
    """Which backend trains the policy and how.

    backend: ``torch`` (the plain-PyTorch ``DecoderLM``, the oracle) or ``megatron``
    (megatron-core ``GPTModel``; TP x PP > 1 need it). micro_batch: sequences per
    log-prob / update forward (length-sorted). micro_batch_tokens > 0 (torch backend): also at
    most that many padded tokens (rows x longest row) per micro-batch, a long sequence alone
    if need be: short sequences batch, long ones split, which evens out the pipelined
    update's pieces. separate_logprob_pass: recompute the old
    log-probs in a no-grad pass of their own instead of the update forward's (detached;
    ratio 1 with one optimizer step per batch). clip_eps: PPO ratio clip. kl_coef > 0
    keeps a frozen reference policy and adds a k3 KL penalty. sequence_parallel (megatron,
    TP > 1): megatron's sequence parallelism (norms, dropout and the residual stream split over
    the sequence across TP ranks). recompute (megatron): activation recompute, ``none``,
    ``full`` (every decoder layer recomputed in backward) or ``selective`` (core attention only). The weights dtype is the
    run's ``model.dtype`` (handed to the backend with its device), not a key of this block.
    pipelined_update (torch backend): each GRPO group's gradient is computed as soon as its
    rollouts are complete, by whichever rank is free (with TLT, while other rows still
    decode), in micro-batches of that group alone, summed in fixed point
    (``nemo_tlt.policy.fixed_point``) so the step's gradient does not depend on who computed
    what when; one optimizer step per RL step, as without it. TLT and its baseline both sum
    this way (the baseline computes its own groups after the rollout), so they stay
    bit-identical.
    """

    backend: str = "torch"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    micro_batch: int = 4
    micro_batch_tokens: int = 0
    separate_logprob_pass: bool = False
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    sequence_parallel: bool = False
    recompute: str = "none"
    pipelined_update: bool = False
    optim: PolicyOptimConfig = field(default_factory=PolicyOptimConfig)

    def __post_init__(self) -> None:
        BACKENDS.check(self.backend)
        check_int("policy.tensor_parallel", self.tensor_parallel, 1)
        check_int("policy.pipeline_parallel", self.pipeline_parallel, 1)
        if self.backend != "megatron" and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            raise ValueError(f"policy.tensor_parallel / policy.pipeline_parallel > 1 need policy.backend=megatron, "
                             f"got backend {self.backend!r}")
        check_int("policy.micro_batch", self.micro_batch, 1)
        check_int("policy.micro_batch_tokens", self.micro_batch_tokens, 0)
        if self.micro_batch_tokens and self.backend != "torch":
            raise ValueError("policy.micro_batch_tokens > 0 needs policy.backend=torch (megatron's micro-batches are "
                             "fixed-size)")
        if not isinstance(self.separate_logprob_pass, bool):
            raise ValueError(f"policy.separate_logprob_pass must be a bool, got {self.separate_logprob_pass!r}")
        check_float("policy.clip_eps", self.clip_eps, 0, 1, lo_open=True, hi_open=True)
        check_float("policy.kl_coef", self.kl_coef, 0)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"policy.sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and (self.backend != "megatron" or self.tensor_parallel < 2):
            raise ValueError("policy.sequence_parallel=true needs policy.backend=megatron and "
                             f"policy.tensor_parallel > 1, got backend {self.backend!r}, "
                             f"tensor_parallel {self.tensor_parallel}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"policy.recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        if self.recompute != "none" and self.backend != "megatron":
            raise ValueError(f"policy.recompute={self.recompute!r} needs policy.backend=megatron (the torch backend "
                             "keeps every activation)")
        if not isinstance(self.pipelined_update, bool):
            raise ValueError(f"policy.pipelined_update must be a bool, got {self.pipelined_update!r}")
        if self.pipelined_update and self.backend == "megatron":
            # (a backend named by import path is held to PipelinedAccumulation when the run starts)
            raise ValueError(f"policy.pipelined_update=true needs policy.backend=torch, got {self.backend!r} (a "
                             "model-parallel replica would have to compute every group together)")
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"policy.optim must be an OptimConfig, got {type(self.optim).__name__}")

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one model replica together (TP x PP)."""
        return self.tensor_parallel * self.pipeline_parallel
