"""The learned SD policy: per step, plain decoding or a tree shape, chosen from what
the steps that ran cost.

Contract
--------
* Implements :class:`~nemo_tlt.adaptive.sd_policy.SpecPolicy` (``choose`` /
  ``observe``). Its choices depend only on running-row counts, tokens-kept counts
  and step timings, never on the tokens sampled, so every acceptance mode stays
  lossless whatever it picks.
* Plain decoding is arm 0, beside the tree shapes; the measure and the bounded
  exploration are those of :class:`~nemo_tlt.adaptive.arm_costs.ArmCosts`: every
  step of an arm informs its estimate at every batch size (moved along the arm's
  fitted step-cost curve, weighted by closeness in batch size), a short start-up
  profile pulls each arm ``min_pulls`` times, and probes go where an arm could be
  the best and its estimate rests on the fewest steps, if the probe is cheap there:
  its expected loss at most ``probe_cost`` times the median measured step, so an arm
  far behind in the crowded head is probed in the tail instead.
* ``max_sd_running`` is an optional bound (never speculate above that many rows),
  not the mechanism.
* A :class:`~nemo_tlt.adaptive.collapse.CollapseGuard` watches the accepted length
  per row of the SD steps: when it collapses (untrained or stale drafter), every
  step decodes plainly and one SD step with the cheapest tree (fewest verified
  nodes) probes the drafter on exponential back-off. A probe that accepts again ends
  the collapse and the tree arms are measured afresh.
* An SD step right after plain steps (or the first of a rollout) also runs the
  drafter over every position it has not seen (the prompts, the plainly decoded
  tokens): a cost of having decoded plainly, paid once whichever tree comes next, so
  its time is kept out of the estimates (its acceptance still counts for collapse);
  recorded, it would make whichever tree runs first look several times too slow.
  The same tree then runs one more step, which is measured: a probe of a tree in a
  batch size where plain decoding leads would otherwise never be.
* :meth:`drafter_updated` is called when the drafter's weights change: what the tree
  arms measured (acceptance is the drafter's) is discounted (kept steps halved, probe
  waits halved) and a collapsed drafter is probed again soon; plain decoding's
  measurements do not depend on the drafter and are kept.
* ``state_dict`` is JSON-serialisable and restores the same future choices. A state
  of version 1 (per-bucket tables) is refused with an error that says so: its
  throughput windows hold no step times, so they cannot be carried over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from nemo_tlt.adaptive.arm_costs import ArmCosts
from nemo_tlt.adaptive.collapse import CollapseGuard
from nemo_tlt.adaptive.sd_policy import check_outcome, check_running
from nemo_tlt.checks import check_float, check_int
from nemo_tlt.speculative.tree_shape import TreeShape, parse_arms

_STATE_VERSION = 2


@dataclass(frozen=True)
class LearnedSDConfig:
    """Arms, cost sharing across batch sizes, exploration and collapse detection of a :class:`LearnedSDPolicy`."""

    arms: List[Any] = field(default_factory=lambda: ["4_1_4", "6_2_12"])  # "4_2_8" strings parsed here, once
    window: int = 16             # steps kept per arm and octave of batch size ([4, 7], [8, 15], ...)
    min_pulls: int = 2           # start-up: pulls of every arm (plain too) before the estimates decide
    # A step at a batch size this factor away from the one decided weighs 0.61, two
    # factors away 0.14: the right choice changes with the batch size, slowly.
    bandwidth: float = 2.0
    # The relative error of an estimate that rests on one step: an arm is probed where
    # its estimate x (1 + probe_spread / sqrt(1 + steps near)) reaches the best one.
    probe_spread: float = 0.3
    # How far the fitted step-time exponent may be off: an estimate moved by a factor f
    # in batch size may be off by f**exponent_error (its optimistic bound allows that).
    exponent_error: float = 0.25
    # A probe is made only where its expected loss (time beyond the best arm's for the same
    # tokens) is at most this share of the median measured step: not in the crowded head
    # for an arm far behind there (see arm_costs.py).
    probe_cost: float = 0.25
    probe_shortest: int = 8      # decode steps before a losing arm is first probed again
    probe_longest: int = 256     # the longest a plausible losing arm goes unprobed (decode steps)
    collapse_accept: float = 1.3  # accepted tokens per row per SD step below which SD is lost
    collapse_steps: int = 3      # SD steps whose pooled acceptance decides a collapse...
    collapse_rows: int = 16      # ...or fewer, as soon as they hold this many rows
    reprobe_shortest: int = 16   # decode steps before a collapsed drafter is first probed
    reprobe_longest: int = 1024  # the longest a collapsed drafter goes unprobed (decode steps)
    max_sd_running: Optional[int] = None  # optional bound: never speculate above this many rows

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", parse_arms(self.arms, "LearnedSDConfig"))
        check_int("LearnedSDConfig.window", self.window, 1)
        check_int("LearnedSDConfig.min_pulls", self.min_pulls, 1, self.window)
        check_float("LearnedSDConfig.bandwidth", self.bandwidth, 1.0, lo_open=True)
        check_float("LearnedSDConfig.probe_spread", self.probe_spread, 0.0)
        check_float("LearnedSDConfig.exponent_error", self.exponent_error, 0.0, 1.0)
        check_float("LearnedSDConfig.probe_cost", self.probe_cost, 0.0)
        check_int("LearnedSDConfig.probe_shortest", self.probe_shortest, 1)
        check_int("LearnedSDConfig.probe_longest", self.probe_longest, self.probe_shortest)
        check_float("LearnedSDConfig.collapse_accept", self.collapse_accept, 1.0)
        check_int("LearnedSDConfig.collapse_steps", self.collapse_steps, 1)
        check_int("LearnedSDConfig.collapse_rows", self.collapse_rows, 1)
        check_int("LearnedSDConfig.reprobe_shortest", self.reprobe_shortest, 1)
        check_int("LearnedSDConfig.reprobe_longest", self.reprobe_longest, self.reprobe_shortest)
        if self.max_sd_running is not None:
            check_int("LearnedSDConfig.max_sd_running", self.max_sd_running, 1)


class LearnedSDPolicy:
    """Plain or which tree, per step, learned online from step costs (see the module docstring)."""

    def __init__(self, config: LearnedSDConfig) -> None:
        if not isinstance(config, LearnedSDConfig):
            raise ValueError(f"LearnedSDPolicy.config must be a LearnedSDConfig, got {type(config).__name__}")
        self.config = config
        self._choices: tuple[TreeShape | None, ...] = (None, *config.arms)
        self._index = {shape: i for i, shape in enumerate(self._choices)}
        self.costs, self.guard = self._fresh_costs(), self._fresh_guard()
        self._previous: tuple[int, int] | None = None  # (running, arm) of the last observed step
        # A tree whose last step only caught the drafter up (not recorded): run it once more
        # so that it is measured; else a probe after plain steps never would be.
        self._pending: int | None = None
        # The drafter probe: the tree that verifies the fewest nodes is the cheapest to lose.
        self._probe_arm = 1 + min(range(len(config.arms)),
                                  key=lambda i: (config.arms[i].num_verify, config.arms[i].depth, i))

    @property
    def collapsed(self) -> bool:
        """Whether the drafter currently counts as collapsed (plain decoding everywhere)."""
        return self.guard.collapsed

    def choose(self, num_running: int) -> TreeShape | None:
        check_running(num_running)
        self.guard.tick()
        bound = self.config.max_sd_running
        if bound is not None and num_running > bound:
            arm = 0
        elif self.guard.collapsed:
            arm = self._probe_arm if self.guard.probe_due() else 0
        elif self._pending is not None:
            arm = self._pending
        else:
            arm = self.costs.choose(num_running, catch_up=self._catching_up(num_running))
        return self._choices[arm]

    def _catching_up(self, num_running: int) -> bool:
        """Whether a tree run at ``num_running`` rows starts by catching the drafter up: the
        first SD step of a rollout (begin_rollout, or more running rows than the last step:
        rows only finish within one) or the first after plain steps."""
        previous = self._previous
        return previous is None or previous[1] == 0 or num_running > previous[0]

    def best_choice(self, num_running: int) -> TreeShape | None:
        """What the estimates pick at ``num_running`` rows, without exploring or any side
        effect (plain decoding while collapsed or above ``max_sd_running``; the first tree
        while nothing is measured)."""
        check_running(num_running)
        bound = self.config.max_sd_running
        if self.guard.collapsed or (bound is not None and num_running > bound):
            return None
        arm = self.costs.best(num_running)
        return self.config.arms[0] if arm is None else self._choices[arm]

    def observe(self, num_running: int, shape: TreeShape | None, tokens_generated: int, elapsed_s: float) -> None:
        check_running(num_running)
        check_outcome(tokens_generated, elapsed_s)
        arm = self._index.get(shape) if shape is None or isinstance(shape, TreeShape) else None
        if arm is None:
            names = ", ".join(a.name for a in self.config.arms)
            raise ValueError(f"observe: shape {shape!r} is neither None (plain) nor one of the arms ({names})")
        catching_up = arm != 0 and self._catching_up(num_running)
        self._previous = (int(num_running), arm)
        if arm and self.guard.record(tokens_generated / num_running, num_running) == "recovered":
            # A drafter that accepts again is a different drafter: measure its trees afresh.
            self.costs.forget(range(1, len(self._choices)))
        if not catching_up:
            self.costs.record(num_running, arm, tokens_generated, elapsed_s)
        self._pending = arm if catching_up else None

    def begin_rollout(self) -> None:
        """A new rollout: its first SD step catches the drafter up on the prompts, whatever
        the running count (rows cut off at max_new_tokens leave as many as the next starts with)."""
        self._previous = None

    def drafter_updated(self) -> None:
        """The drafter's weights changed: discount what depended on them."""
        self.costs.discount(range(1, len(self._choices)))
        self.guard.drafter_changed()

    def log_dict(self, prefix: str = "sd_policy") -> dict[str, float]:
        """Flat scalars: collapse state; per choice (plain is named 'plain') its pulls, its
        fitted step-time exponent, and its estimate at 1, 2, 4, ... rows up to the largest
        batch measured, with the steps it rests on there."""
        out = {f"{prefix}/collapsed": float(self.guard.collapsed), f"{prefix}/collapses": float(self.guard.collapses)}
        sizes = [1 << k for k in range(self.costs.largest_running().bit_length())]
        for arm, shape in enumerate(self._choices):
            name = "plain" if shape is None else shape.name
            out[f"{prefix}/pulls/{name}"] = float(self.costs.pulls()[arm])
            out[f"{prefix}/step_time_exponent/{name}"] = self.costs.exponent(arm)
            for r in sizes:
                est = self.costs.estimate(arm, r)
                if est is not None:
                    out[f"{prefix}/at{r}/tokens_per_s/{name}"] = est.value
                    out[f"{prefix}/at{r}/steps_near/{name}"] = est.near
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "kind": "learned", "arms": [a.name for a in self.config.arms],
                "costs": self.costs.state_dict(), "collapse": self.guard.state_dict(),
                "previous": None if self._previous is None else list(self._previous), "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and state.get("kind") == "learned" and state.get("version") == 1:
            raise ValueError(f"LearnedSDPolicy state has version 1 (per-bucket throughput tables, no step "
                             f"times); this policy reads version {_STATE_VERSION} (step costs shared across "
                             f"batch sizes) and cannot carry it over: drop the checkpoint's sd_policy state "
                             f"and the policy starts afresh")
        if not isinstance(state, dict) or state.get("kind") != "learned" or state.get("version") != _STATE_VERSION:
            raise ValueError(f"LearnedSDPolicy state must be a dict with kind 'learned' and version "
                             f"{_STATE_VERSION}, got {state if not isinstance(state, dict) else state.get('kind')!r}")
        arms = [a.name for a in self.config.arms]
        if state.get("arms") != arms:
            raise ValueError(f"LearnedSDPolicy state 'arms'={state.get('arms')!r} does not match this policy's {arms}")
        previous = state.get("previous")
        if previous is not None and not (isinstance(previous, list) and len(previous) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in previous)
                and previous[0] >= 1 and 0 <= previous[1] < len(self._choices)):
            raise ValueError(f"LearnedSDPolicy state 'previous' must be null or [running, arm], got {previous!r}")
        pending = state.get("pending")
        if pending is not None and not (isinstance(pending, int) and not isinstance(pending, bool)
                                        and 1 <= pending < len(self._choices)):
            raise ValueError(f"LearnedSDPolicy state 'pending' must be null or a tree arm index, got {pending!r}")
        costs, guard = self._fresh_costs(), self._fresh_guard()
        costs.load_state_dict(state.get("costs"))  # into fresh copies: a bad state changes nothing
        guard.load_state_dict(state.get("collapse"))
        self.costs, self.guard = costs, guard
        self._previous = None if previous is None else (previous[0], previous[1])
        self._pending = pending

    def _fresh_costs(self) -> ArmCosts:
        c = self.config
        return ArmCosts(len(self._choices), c.window, c.min_pulls, c.bandwidth, c.probe_spread,
                        c.exponent_error, c.probe_shortest, c.probe_longest, c.probe_cost)

    def _fresh_guard(self) -> CollapseGuard:
        c = self.config
        return CollapseGuard(c.collapse_accept, c.collapse_steps, c.collapse_rows, c.reprobe_shortest,
                             c.reprobe_longest)
