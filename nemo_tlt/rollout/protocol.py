"""The `RolloutEngine` protocol and the values that cross it.

`RolloutEngine` is the whole surface an RL loop uses from a rollout engine: the
served model's shape, policy-weight refit, drafter swap, and `generate`. The
embedded torch engine (``torch_engine.py``) is the default and the oracle; every
engine passes the same conformance suite (``tests/conformance``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.drafter.base import Drafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.speculative.sampling import SamplingParams

# Canonical (HF Llama / Qwen2-named) policy weights: a whole mapping, or a stream of
# (name, tensor) pairs consumed once (a Megatron gather streams layer by layer).
PolicyWeights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    seq_id: int | None = None  # keys the coupled-sampling noise; defaults to the request's index

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))


@dataclass
class RequestResult:
    tokens: list[int]
    stop_reason: str                          # "eos" | "length"
    # [prompt_len + len(tokens) - 1, F]: the drafter feature at t (it predicts t+1): the
    # final hidden state (F = H), or with an EAGLE-3 drafter loaded the outputs of its
    # capture_layers concatenated, then the final state (F = (k+1)*H): the very rows
    # the drafter trains on
    hidden_states: torch.Tensor | None = None
    # one float per token of `tokens`: the target's log-probability of that token under the
    # sampling transform that drew it (speculative.sampling.token_logprobs: temperature,
    # top-k, top-p for rejection / coupled; the raw log-softmax at temperature 1 for greedy),
    # from the logits that predicted it (with SD: the verify forward's, no extra forward)
    logprobs: list[float] = field(default_factory=list)


# (the request's index in ``requests``, its final result): ``RolloutEngine.generate``'s ``on_finish``
FinishSink = Callable[[int, RequestResult], None]


@dataclass
class StepTrace:
    """What one decode step ran: the one per-step record (policies keep none)."""

    running: int
    shape: str | None          # tree shape name that ran, None for a plain step
    tokens: int                # tokens emitted in this step (all rows)
    mean_accept: float         # tokens per row in this step
    seconds: float
    kv_bytes: int = 0          # KV cache bytes held (target + drafter) during the step
    host_syncs: int = 0        # values read back from the device (nemo_tlt.model.host), finished rows' included


@dataclass
class GenerationStats:
    target_forwards: int = 0     # prefill chunks + decode steps
    prefill_forwards: int = 0
    drafter_forwards: int = 0
    plain_steps: int = 0
    sd_steps: int = 0
    tokens_generated: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens per row per verify step (1..depth+1)
    # Host clock around each phase. On the CPU that is its compute; on CUDA, kernels run
    # asynchronously, so these hold the host-side (launch) time and the kernels' time lands
    # in the phase whose host read waits for it (time_other_s). The per-step dt in `trace`
    # and wall_s are taken after the step's host read: they are the real step times there.
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_plain_s: float = 0.0
    time_other_s: float = 0.0
    prefill_s: float = 0.0       # allocation + prompt forwards + first token (part of time_plain_s and other)
    wall_s: float = 0.0
    host_syncs: int = 0          # values read back from the device in the whole call (prefill included)
    trace: list[StepTrace] = field(default_factory=list)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def outside_steps_s(self) -> float:
        """Wall time not spent in decode steps: prefill, retiring finished rows, policy."""
        return self.wall_s - sum(t.seconds for t in self.trace)

    def accept_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.accept_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    def summary(self) -> dict[str, Any]:
        return {
            "target_forwards": self.target_forwards,
            "prefill_forwards": self.prefill_forwards,
            "drafter_forwards": self.drafter_forwards,
            "plain_steps": self.plain_steps,
            "sd_steps": self.sd_steps,
            "tokens_generated": self.tokens_generated,
            "mean_accept_len": self.mean_accept_len,
            "accept_histogram": self.accept_histogram(),
            "time_draft_s": self.time_draft_s,
            "time_verify_s": self.time_verify_s,
            "time_plain_s": self.time_plain_s,
            "time_other_s": self.time_other_s,
            "prefill_s": self.prefill_s,
            "outside_steps_s": self.outside_steps_s,
            "wall_s": self.wall_s,
            "host_syncs": self.host_syncs,
        }


@dataclass
class GenerateOutput:
    results: list[RequestResult]
    stats: GenerationStats
    # where RequestResult.logprobs come from: "engine" (computed as the contract says) or
    # "none" (an engine that cannot report them in this configuration: NaN, one per token;
    # the exact ones are the policy's own forward's)
    logprobs_from: str = "engine"


SAMPLING_MODES = ("greedy", "rejection", "coupled")
SUITE_DRAFTERS = ("eagle", "eagle3", "medusa", "oracle", "adversarial")  # what the conformance suite drafts with


@dataclass(frozen=True)
class EngineLimits:
    """What an engine declares it cannot do, on its class (``LIMITS``); the conformance suite
    (``tests/conformance``) reads it there, skips the cases that need a declared limit, and
    checks that each declared limit is refused by name.

    ``modes``: the sampling modes it runs. ``hidden_states``: ``generate(return_hidden=True)``.
    ``step_stats``: per-step ``GenerationStats`` (forwards, SD / plain steps, the trace).
    ``drafter_kinds``: the drafter kinds it speculates with (the suite's names; ``oracle`` and
    ``adversarial`` are test drafters). ``drafter_form``: what ``load_drafter`` takes, a torch
    ``Drafter`` ("module") or an EAGLE-3 HF folder ("eagle3-hf"); ``eagle3_modules``: an
    "eagle3-hf" engine that also takes an ``Eagle3Drafter`` module. ``sd_top_k``: rejection
    top-k while it can speculate. ``sd_logprobs``: log-probs while a drafter is loaded (else
    ``GenerateOutput.logprobs_from`` is "none"). ``why``: where the limits are explained.
    ``reasons``: ``(key, why)`` pairs a training run's refusal quotes (``rollout.run_limits``):
    ``modes`` (a sampling mode it lacks), ``drafter_modules`` (it takes no torch drafter module,
    which the RL loop retrains), ``hidden_states``."""

    modes: tuple[str, ...] = SAMPLING_MODES
    hidden_states: bool = True
    step_stats: bool = True
    drafter_kinds: tuple[str, ...] = SUITE_DRAFTERS
    drafter_form: str = "module"
    eagle3_modules: bool = False
    sd_top_k: bool = True
    sd_logprobs: bool = True
    why: str = ""
    reasons: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not set(self.modes) <= set(SAMPLING_MODES):
            raise ValueError(f"EngineLimits.modes must be among {list(SAMPLING_MODES)}, got {list(self.modes)}")
        if self.drafter_form not in ("module", "eagle3-hf"):
            raise ValueError(f"EngineLimits.drafter_form must be 'module' or 'eagle3-hf', got {self.drafter_form!r}")

    @property
    def takes_drafter_modules(self) -> bool:
        """Whether ``load_drafter`` takes the torch drafter modules the RL loop trains."""
        return self.drafter_form == "module" or self.eagle3_modules

    def reason(self, key: str) -> str:
        """The declared reason for limit ``key`` (``reasons``), or ``why``."""
        return dict(self.reasons).get(key, self.why)

    def phrases(self) -> list[str]:
        """What the engine cannot do, one phrase each."""
        out = [f"mode {m!r}" for m in SAMPLING_MODES if m not in self.modes]
        out += [] if self.hidden_states else ["return_hidden"]
        out += [] if self.step_stats else ["per-step stats"]
        out += [f"drafter kind {k!r}" for k in SUITE_DRAFTERS if k not in self.drafter_kinds]
        out += [] if self.sd_top_k else ["rejection top-k while it can speculate"]
        out += [] if self.sd_logprobs else ["log-probs while a drafter is loaded"]
        return out


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine serving one target model, optionally with a drafter.

    Contracts every implementation keeps (checked by ``tests/conformance``):

    * Lossless: greedy output with any SD policy is token-identical to plain greedy;
      ``coupled`` output is identical to plain ``coupled`` for the same seed and
      ``Request.seq_id``, whatever the tree shapes and the batch composition;
      ``rejection`` samples exactly the plain sampling distribution.
    * Log-probs: every result carries ``logprobs``, one float per generated token, the
      target's log-probability of that token under the sampling transform used
      (``speculative.sampling.token_logprobs``); with SD they come from the verify
      forward and equal plain decoding's within fp32 rounding (the conformance suite
      holds them to 1e-5 in fp32 and to an independent full forward). An engine that
      cannot compute them so says in its docstring and, per call, in
      ``GenerateOutput.logprobs_from`` ("none": NaN, one per token).
    * Calls do not leak into each other: the output of `generate` depends only on its
      arguments, the loaded policy weights and (for speed, never for tokens) the drafter.
    * Errors are ``ValueError`` naming the field or tensor at fault, raised before any
      state changes unless stated otherwise.
    """

    @property
    def model_config(self) -> LMConfig:
        """The served model's architecture (vocab_size, hidden_size, context, eos...)."""
        ...

    def load_policy_weights(self, weights: PolicyWeights) -> None:
        """Replace the served model's weights with canonical (HF-named) full tensors.

        ``weights`` is a mapping or an iterable of (name, tensor) pairs consumed once,
        in any order. Strict: an unknown name, a name given twice or a wrong shape is a
        ValueError naming the tensor as soon as it arrives; a name never given is a
        ValueError naming it when the stream ends. A half-loaded model is never
        served: after a load that failed once it had written tensors, `generate`
        refuses to run (ValueError) until a complete load succeeds; a load refused
        before it wrote anything leaves the served model as it was. (How much an
        engine writes before the stream ends is its own: the torch engine writes
        each tensor as it arrives, TensorRT-LLM's sends buckets.) A tensor-parallel engine
        whose class sets ``accepts_rollout_slices = True`` (the torch engine) also takes only
        its rank's rollout slices under the same names (``nemo_tlt.weights.rollout``); others
        take whole tensors.
        """
        ...

    def load_drafter(self, drafter: Drafter | None) -> None:
        """Install the drafter the next `generate` calls draft with; None removes it.
        A drafter built for another target is refused with a ValueError."""
        ...

    def generate(self, requests: list[Request], sampling: SamplingParams, *,
                 policy: SpecPolicy | None = None, return_hidden: bool = False,
                 on_finish: FinishSink | None = None) -> GenerateOutput:
        """Decode every request to EOS (when ``sampling.stop_on_eos``; included as the last
        token, stop_reason "eos") or ``sampling.max_new_tokens`` (stop_reason "length").

        ``policy`` decides each decode step (``begin_rollout`` once, then ``choose`` /
        ``observe`` per step); None decodes plainly. A policy that asks for a tree while
        no drafter is loaded is a ValueError. Results come in request order; with
        ``return_hidden`` each carries the target's final hidden states
        [prompt_len + len(tokens) - 1, hidden_size] (the state at t predicts token t+1),
        or, when the loaded drafter declares ``capture_layers`` (EAGLE-3), the outputs of
        those target layers concatenated, then the final hidden state,
        [..., (len(capture_layers) + 1) * hidden_size].
        ``on_finish(index, result)``, if given, is called once per request, on the calling
        thread, as soon as that request's result is final (an engine that finishes every
        request together calls it for each before returning), with the very object
        returned in ``results``; what it raises propagates out of ``generate``. A caller can
        start work on the finished requests while the rest still decode.
        Bad input (no requests, an empty prompt, a token id outside the vocabulary, a
        prompt plus max_new_tokens beyond the context, sampling that is not a valid
        SamplingParams) is a ValueError naming the field, raised before any decoding.
        """
        ...


@runtime_checkable
class SleepsBetweenRollouts(Protocol):
    """An engine that can release its device memory while the policy updates (vLLM's sleep mode,
    ``rollout.vllm.enable_sleep_mode``; ``nemo_tlt.rl.training_state``): ``sleep()`` after a
    rollout frees what the engine holds on its device, keeping what it needs to serve the same
    weights again; the engine wakes by itself at its next ``load_policy_weights``,
    ``load_drafter`` or ``generate``, and then serves exactly as before it slept. ``sleeps``:
    whether ``sleep()`` releases anything (False: it does nothing)."""

    @property
    def sleeps(self) -> bool: ...

    def sleep(self) -> None: ...
