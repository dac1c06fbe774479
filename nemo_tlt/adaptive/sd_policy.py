"""Per-step speculative-decoding policy: SD on or off, and which tree shape.

Contract
--------
The rollout engine talks to a :class:`SpecPolicy` once per decode step::

    shape = policy.choose(num_running)          # None -> plain decoding
    ...decode one step (SD with `shape`, or plain)...
    policy.observe(num_running, shape, tokens_generated, elapsed_s)

``tokens_generated`` counts the tokens the step appended over the whole batch
(accepted length x batch size for SD, the batch size for plain decoding).

:class:`AdaptiveSDPolicy` keeps SD off while the batch is large (decoding is
compute-bound there and verification of a draft tree is not free) and turns it
on for the long tail. The switch has hysteresis: SD turns ON when
``num_running <= threshold_on`` and OFF only when ``num_running > threshold_off``,
so a running count hovering around one threshold does not flip the mode (and
with it the engine's KV/tree buffers) every step. When SD is on, the tree shape
comes from a :class:`~nemo_tlt.adaptive.bandit.BegMab` (fed with throughput
rewards from :meth:`observe`) or is a fixed shape.

:class:`FixedSDPolicy` always decodes with one shape, or always plainly; it is
the baseline for benchmarks and the policy of engine tests.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from nemo_tlt.adaptive.bandit import BegMab
from nemo_tlt.adaptive.step_cost import StepCostFit
from nemo_tlt.speculative.tree_shape import TreeShape

REWARDS = ("scaled", "per_row", "throughput")


@runtime_checkable
class SpecPolicy(Protocol):
    """What the rollout engine asks every decode step."""

    def begin_rollout(self) -> None:
        """A new rollout starts: its rows are new (the engine calls this before its first step)."""
        ...

    def choose(self, num_running: int) -> TreeShape | None:
        """Tree shape for this step, or None for plain (non-speculative) decoding."""
        ...

    def observe(
        self, num_running: int, shape: TreeShape | None, tokens_generated: int, elapsed_s: float
    ) -> None:
        """Outcome of the step decided by the matching :meth:`choose`."""
        ...


@dataclass(frozen=True)
class SDPolicyConfig:
    """When speculative decoding is on.

    SD turns on once ``num_running <= threshold_on`` and off again once
    ``num_running > threshold_off``; ``threshold_off == threshold_on`` means a
    plain threshold without hysteresis.
    """

    threshold_on: int = 32
    threshold_off: int = 48
    # The bandit's reward per step: "throughput" is TLT's tokens / second;
    # "per_row" divides it by the running batch size (accepted length per second);
    # "scaled" divides it by running**(1 - b), b the exponent of step time in batch
    # size fitted online (see step_cost.py). Within one batch-size bucket the batch
    # shrinks as rows finish, so with throughput an arm tried early (more rows) keeps a
    # higher median than one tried later unless a step's cost grows exactly like the
    # batch (b = 1), and per row the other way round unless it does not grow at all
    # (b = 0). "scaled" removes that bias for any b.
    reward: str = "scaled"

    def __post_init__(self) -> None:
        if self.reward not in REWARDS:
            raise ValueError(f"SDPolicyConfig.reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        for name in ("threshold_on", "threshold_off"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SDPolicyConfig.{name} must be an int >= 1, got {value!r}")
        if self.threshold_off < self.threshold_on:
            raise ValueError(
                f"SDPolicyConfig.threshold_off={self.threshold_off} must be >= "
                f"threshold_on={self.threshold_on} (SD turns on at <= threshold_on, off at > threshold_off)"
            )


def check_running(num_running: int) -> None:
    if isinstance(num_running, bool) or not isinstance(num_running, numbers.Integral) or num_running < 1:
        raise ValueError(f"num_running must be an int >= 1, got {num_running!r}")


def check_outcome(tokens_generated: int, elapsed_s: float) -> None:
    if (
        isinstance(tokens_generated, bool)
        or not isinstance(tokens_generated, numbers.Integral)
        or tokens_generated < 0
    ):
        raise ValueError(f"tokens_generated must be an int >= 0, got {tokens_generated!r}")
    finite_positive = isinstance(elapsed_s, numbers.Real) and 0.0 < elapsed_s < math.inf
    if isinstance(elapsed_s, bool) or not finite_positive:
        raise ValueError(f"elapsed_s must be a finite number > 0, got {elapsed_s!r}")


class _RunningCountPolicy:
    """The hooks both policies here share: they decide from the running count alone.
    What each step ran is recorded by the engine (``GenerationStats.trace``)."""

    def drafter_updated(self) -> None:
        """The drafter's weights changed. These policies keep no estimate that depends
        on the drafter's quality beyond their window (see LearnedSDPolicy for one that does)."""

    def begin_rollout(self) -> None:
        """A new rollout starts. These policies decide from the running count alone."""


class AdaptiveSDPolicy(_RunningCountPolicy):
    """SD for the long tail, with hysteresis; tree shape from a bandit or fixed."""

    def __init__(
        self,
        config: SDPolicyConfig,
        bandit: BegMab | None = None,
        fixed_shape: TreeShape | None = None,
    ) -> None:
        if not isinstance(config, SDPolicyConfig):
            raise ValueError(
                f"AdaptiveSDPolicy.config must be an SDPolicyConfig, got {type(config).__name__}"
            )
        if bandit is not None and fixed_shape is not None:
            raise ValueError("AdaptiveSDPolicy: give either bandit or fixed_shape, not both")
        if bandit is None and fixed_shape is None:
            raise ValueError("AdaptiveSDPolicy: give a bandit or a fixed_shape (no policy at all means plain decoding)")
        if bandit is not None and not isinstance(bandit, BegMab):
            raise ValueError(f"AdaptiveSDPolicy.bandit must be a BegMab, got {type(bandit).__name__}")
        if fixed_shape is not None and not isinstance(fixed_shape, TreeShape):
            raise ValueError(f"AdaptiveSDPolicy.fixed_shape must be a TreeShape, got {fixed_shape!r}")
        self.config = config
        self.bandit = bandit
        self.fixed_shape = fixed_shape
        self._sd_on = False
        self.step_cost = StepCostFit()
        if bandit is not None:  # the bandit ranks reward / running**exponent (see BegMab)
            bandit.set_size_exponent(self._exponent())

    @property
    def sd_on(self) -> bool:
        """Whether the last :meth:`choose` left SD switched on."""
        return self._sd_on

    def choose(self, num_running: int) -> TreeShape | None:
        check_running(num_running)
        if self._sd_on and num_running > self.config.threshold_off:
            self._sd_on = False
        elif not self._sd_on and num_running <= self.config.threshold_on:
            self._sd_on = True
        shape = self._shape_for(num_running) if self._sd_on else None
        return shape

    def _shape_for(self, num_running: int) -> TreeShape:
        if self.bandit is not None:
            return self.bandit.select(num_running)
        assert self.fixed_shape is not None  # guaranteed by __init__
        return self.fixed_shape

    def observe(
        self, num_running: int, shape: TreeShape | None, tokens_generated: int, elapsed_s: float
    ) -> None:
        check_running(num_running)
        check_outcome(tokens_generated, elapsed_s)
        # Plain steps carry no information about tree shapes; fixed shapes learn nothing.
        if shape is None or self.bandit is None:
            return
        if self.config.reward == "scaled":
            self.step_cost.add(shape.name, num_running, float(elapsed_s))
            self.bandit.set_size_exponent(self._exponent())
        self.bandit.update(num_running, shape, float(tokens_generated) / float(elapsed_s))

    def _exponent(self) -> float:
        """The batch-size exponent the bandit divides rewards by: 0 for throughput, 1 per
        row, 1 - b for "scaled" (b the fitted step-time exponent; see step_cost.py)."""
        if self.config.reward == "scaled":
            return 1.0 - self.step_cost.exponent()
        return 1.0 if self.config.reward == "per_row" else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "sd_on": self._sd_on,
            "bandit": None if self.bandit is None else self.bandit.state_dict(),
            "step_cost": self.step_cost.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("sd_on"), bool) or "bandit" not in state:
            raise ValueError("AdaptiveSDPolicy state must be a dict with 'sd_on' (bool) and 'bandit'")
        if (state["bandit"] is None) != (self.bandit is None):
            raise ValueError(
                "AdaptiveSDPolicy state 'bandit' does not match this policy "
                f"(state has {'no ' if state['bandit'] is None else ''}bandit, "
                f"policy has {'no ' if self.bandit is None else ''}bandit)"
            )
        if self.bandit is not None:
            self.bandit.load_state_dict(state["bandit"])
        if "step_cost" in state:  # optional: states of the older format have none
            self.step_cost.load_state_dict(state["step_cost"])
        if self.bandit is not None:
            self.bandit.set_size_exponent(self._exponent())
        self._sd_on = state["sd_on"]


class FixedSDPolicy(_RunningCountPolicy):
    """Always SD with one tree shape, or (shape None) always plain decoding."""

    def __init__(self, shape: TreeShape | None) -> None:
        if shape is not None and not isinstance(shape, TreeShape):
            raise ValueError(f"FixedSDPolicy.shape must be a TreeShape or None, got {shape!r}")
        self.shape = shape

    def choose(self, num_running: int) -> TreeShape | None:
        check_running(num_running)
        return self.shape

    def observe(
        self, num_running: int, shape: TreeShape | None, tokens_generated: int, elapsed_s: float
    ) -> None:
        check_running(num_running)
        check_outcome(tokens_generated, elapsed_s)

    def state_dict(self) -> dict[str, Any]:
        return {"shape": None if self.shape is None else self.shape.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = None if self.shape is None else self.shape.name
        if not isinstance(state, dict) or state.get("shape", "<missing>") != expected:
            raise ValueError(f"FixedSDPolicy state {state!r} does not match this policy's shape {expected!r}")
