"""What each decoding choice costs at any batch size, learned from every step it ran.

Arms are indices: 0 is plain decoding, 1..K the tree shapes (the policy maps them).

Measure. Each arm keeps its recent steps (batch size r_i, tokens kept, seconds): the
last ``window`` of each octave of batch sizes ([1], [2, 3], [4, 7], ...), so that the
crowded head, a few steps a rollout, is not pushed out by the many tail steps. The
estimate of arm a's throughput at batch r pools all of them: the weighted median of
``throughput_i * (r / r_i) ** (1 - b_a)`` (what step i would have made at r if a
step's time grows like r**b_a, see step_cost.py), each step weighted by
``w_i = exp(-(ln(r / r_i) / ln(bandwidth))**2 / 2)``, so steps at nearby batch sizes
count most and a factor ``bandwidth`` away counts 0.61. b_a is fitted on the arm's
own steps at every batch size, else pooled over the arms (each its own cost level),
else 0.5. Nothing is learned per bucket alone: a step at 12 rows informs 10 and 16
alike, and an arm measured only in the head has an estimate in the tail, moved
along its cost curve. The median shrugs off a slow step (a page fault, a preemption).

Certainty. ``n(a, r) = sum(w_i)`` is how many steps the estimate at r rests on. The
optimistic bound is the same weighted median of ``throughput_i * (r / r_i) ** (1 - b_a)
* f_i ** exponent_error`` (``f_i >= 1`` the factor between r and r_i: one power law
is only roughly right over a wide range of batch sizes, so a step far away says
less), times ``1 + spread / sqrt(1 + n)`` (``spread``: the relative error of an
estimate resting on one step).

Choice. First every arm ``min_pulls`` times in a row, wherever the batch is (plain
first, then the trees in order): a short start-up profile, in the head of the first
rollout. Then the arm with the best estimate at r, except that another arm is
probed when its optimistic bound reaches the best estimate (it could be better) and
either less than one step's worth of its measurements lies near r
(``n < 1``: probe where the estimate is least certain) or its
:class:`~nemo_tlt.adaptive.backoff.Backoff` (counted in steps) is due; each probe
doubles that arm's wait. An arm clearly worse at r (e.g. plain decoding in the tail)
is not probed there at all; one that ties keeps being probed ever more rarely. An arm
whose measurements were discounted (a new drafter) is probed on its back-off even
where it looked clearly worse, until it runs again. No randomness: the same steps and
timings give the same choices.

What a probe costs. Steps differ in price: in a long tail one step at the crowded head
takes as long as five or ten in the tail, so a probe that lands there (a back-off
falls due in the tail, where the estimates are sure, and fires on the next rollout's
first step, where they are not) costs most where it is least needed. A probe is made
only where its expected loss, the time it would take beyond what the best arm needs
for the same tokens (``r * tokens_per_row_a * (1 / v_a - 1 / v_best)``, both from the
estimates), is at most ``probe_cost`` times the median step the estimates rest on (all
arms' kept steps). An arm close to the best is still probed in the head; one far
behind there is probed only where its steps are cheap, and its estimate in the head
moves with those steps along its cost curve. An arm whose measurements were
discounted is probed whatever its estimate says, as above (that estimate is the one
in doubt). And a step that first catches the drafter up (``catch_up``: the first SD
step of a rollout or after plain steps; its time is not recorded) probes no tree
while a tree leads: the probe would be measured only on a second step.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, NamedTuple

import numpy as np

from nemo_tlt.adaptive.backoff import Backoff
from nemo_tlt.adaptive.step_cost import StepCostFit
from nemo_tlt.checks import check_float, check_int


def octave(running: int) -> int:
    """0 for 1 row, 1 for 2-3, 2 for 4-7, ...: where a step is kept."""
    return int(running).bit_length() - 1


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which the cumulative weight reaches half (the mean of the two values
    either side where it reaches half exactly, as the plain median of an even count)."""
    order = np.argsort(values, kind="stable")
    v, cum = values[order], np.cumsum(weights[order])
    half = cum[-1] / 2.0
    i = min(int(np.searchsorted(cum, half * (1.0 - 1e-9))), len(v) - 1)
    if math.isclose(cum[i], half, rel_tol=1e-9) and i + 1 < len(v):
        return float(0.5 * (v[i] + v[i + 1]))
    return float(v[i])


class Estimate(NamedTuple):
    value: float  # tokens per second expected at the batch size asked
    upper: float  # the optimistic bound
    near: float   # how many steps it rests on there (summed weights)


class ArmCosts:
    """Per-arm step records over all batch sizes, pull counts and probe back-offs."""

    def __init__(self, num_arms: int, window: int, min_pulls: int, bandwidth: float, spread: float,
                 exponent_error: float, probe_shortest: int, probe_longest: int,
                 probe_cost: float = math.inf) -> None:
        check_int("ArmCosts.num_arms", num_arms, 1)
        check_int("ArmCosts.window", window, 1)
        check_int("ArmCosts.min_pulls", min_pulls, 1, window)
        check_float("ArmCosts.bandwidth", bandwidth, 1.0, lo_open=True)
        check_float("ArmCosts.spread", spread, 0.0)
        check_float("ArmCosts.exponent_error", exponent_error, 0.0, 1.0)
        check_float("ArmCosts.probe_cost", probe_cost, 0.0)
        self.probe_cost = float(probe_cost)
        self.num_arms, self.window, self.min_pulls = num_arms, window, min_pulls
        self._log_bw = math.log(float(bandwidth))
        self.spread, self.exponent_error = float(spread), float(exponent_error)
        self._steps: list[dict[int, deque[tuple[int, int, float]]]] = [{} for _ in range(num_arms)]
        self._pulls = [0] * num_arms
        self._stale = [False] * num_arms  # discounted and not run since
        self.clock = 0
        self._probes = [Backoff(probe_shortest, probe_longest) for _ in range(num_arms)]
        self._fits = [StepCostFit() for _ in range(num_arms)]  # one group: the arm's own curve
        # (log r, tokens/s, tokens per row) of each arm's kept steps
        self._arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * num_arms
        self._median_step: float | None = None  # seconds: the median kept step of all arms
        self._cache: list[dict[tuple[int, float], Estimate]] = [{} for _ in range(num_arms)]
        self._pooled = StepCostFit()  # groups: arms

    # ---- estimates ------------------------------------------------------------
    def exponent(self, arm: int) -> float:
        """b of step time ~ running**b for ``arm``: its own fit, else pooled, else the prior."""
        own = self._fits[arm].fitted()
        return own if own is not None else self._pooled.exponent()

    def pooled_exponent(self) -> float:
        return self._pooled.exponent()

    def estimate(self, arm: int, running: int) -> Estimate | None:
        """The arm's throughput at batch ``running``, its optimistic bound and the steps it
        rests on there; None if the arm has no steps. Cached per (batch size, exponent)
        until the arm's steps change: the policy asks every arm at every step."""
        b = self.exponent(arm)
        cache = self._cache[arm]
        if (running, b) in cache:
            return cache[(running, b)]
        log_r, tps, _ = self._steps_of(arm)
        if not len(tps):
            return None
        log_f = math.log(running) - log_r
        w = self._weights(log_f)
        moved = tps * np.exp((1.0 - b) * log_f)  # throughput_at, for every step at once
        near = float(w.sum())
        upper = weighted_median(moved * np.exp(self.exponent_error * np.abs(log_f)), w)
        est = Estimate(weighted_median(moved, w), upper * (1.0 + self.spread / math.sqrt(1.0 + near)), near)
        if len(cache) >= 64:  # b moves with every step of an arm that has no fit of its own
            cache.clear()
        cache[(running, b)] = est
        return est

    def _steps_of(self, arm: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays[arm] is None:
            steps = np.array([e for key in sorted(self._steps[arm]) for e in self._steps[arm][key]],
                             dtype=np.float64).reshape(-1, 3)  # (running, tokens, seconds) rows
            self._arrays[arm] = (np.log(steps[:, 0]), steps[:, 1] / steps[:, 2], steps[:, 1] / steps[:, 0])
        return self._arrays[arm]

    def _weights(self, log_f: np.ndarray) -> np.ndarray:
        return np.exp(-0.5 * (log_f / self._log_bw) ** 2)

    def probe_loss(self, arm: int, best: int, running: int) -> float | None:
        """Seconds a step of ``arm`` at ``running`` rows is expected to take beyond what
        ``best`` needs for the same tokens (tokens per row: the weighted median of the
        arm's steps near ``running``); None if either arm has no steps or made no tokens
        there (nothing to price a probe by)."""
        a, b = self.estimate(arm, running), self.estimate(best, running)
        if a is None or b is None or a.value <= 0.0 or b.value <= 0.0:
            return None
        log_r, _, tpr = self._steps_of(arm)
        tokens = running * weighted_median(tpr, self._weights(math.log(running) - log_r))
        return max(0.0, tokens * (1.0 / a.value - 1.0 / b.value))

    def median_step(self) -> float | None:
        """The median seconds of every kept step (all arms): a probe's price is judged against it."""
        if self._median_step is None:
            seconds = [s for arm in self._steps for steps in arm.values() for _, _, s in steps]
            self._median_step = float(np.median(seconds)) if seconds else None
        return self._median_step

    def _changed(self, arm: int) -> None:
        self._arrays[arm], self._cache[arm] = None, {}
        self._median_step = None

    def best(self, running: int) -> int | None:
        """The arm with the best estimate at ``running`` (ties: lowest index); None if none pulled."""
        best, value = None, -1.0
        for arm in range(self.num_arms):
            est = self.estimate(arm, running)
            if est is not None and est.value > value:
                best, value = arm, est.value
        return best

    # ---- choosing and recording ---------------------------------------------------------
    def choose(self, running: int, catch_up: bool = False) -> int:
        """The arm for a step at batch ``running`` (advances the step clock). ``catch_up``:
        a tree run now would first catch the drafter up, unmeasured (see the module docstring)."""
        self.clock += 1
        pulls = self._pulls
        ests = [self.estimate(a, running) for a in range(self.num_arms)]
        if min(pulls) < self.min_pulls or any(e is None for e in ests):
            # Each arm its pulls in a row, plain first: one switch from plain to trees, and
            # so one catch-up of the drafter (see learned_policy.py), in the start-up.
            return min(a for a in range(self.num_arms) if pulls[a] < self.min_pulls or ests[a] is None)
        best = max(range(self.num_arms), key=lambda a: (ests[a].value, -a))
        due = []
        for a in range(self.num_arms):
            if a == best or (catch_up and a != 0 and best != 0):
                continue
            backoff_due = self._probes[a].due(self.clock)
            if self._stale[a] and backoff_due:
                due.append(a)
            elif (ests[a].upper >= ests[best].value and (ests[a].near < 1.0 or backoff_due)
                  and self._affordable(a, best, running)):
                due.append(a)
        if not due:
            return best
        arm = min(due, key=lambda a: (ests[a].near, a))  # the least certain first
        self._probes[arm].failed(self.clock)
        return arm

    def _affordable(self, arm: int, best: int, running: int) -> bool:
        if math.isinf(self.probe_cost):
            return True
        loss, typical = self.probe_loss(arm, best, running), self.median_step()
        return loss is None or typical is None or loss <= self.probe_cost * typical

    def record(self, running: int, arm: int, tokens: int, seconds: float) -> None:
        key = octave(running)
        steps = self._steps[arm].setdefault(key, deque(maxlen=self.window))
        steps.append((int(running), int(tokens), float(seconds)))
        self._changed(arm)
        self._pulls[arm] += 1
        self._stale[arm] = False
        self._fits[arm].add("arm", running, seconds)
        self._pooled.add(str(arm), running, seconds)

    def discount(self, arms: Iterable[int]) -> None:
        """Trust what ``arms`` measured half as much: each octave keeps its newer half
        (at least one step) and each probe wait halves."""
        for arm in arms:
            for key, steps in self._steps[arm].items():
                self._steps[arm][key] = deque(list(steps)[len(steps) // 2:], maxlen=self.window)
            self._changed(arm)
            self._probes[arm].halve(self.clock)
            self._stale[arm] = True

    def forget(self, arms: Iterable[int]) -> None:
        """Drop what ``arms`` measured (steps and pull counts): they are tried afresh.
        Their step-time fits stay: timing does not depend on the drafter."""
        for arm in arms:
            self._steps[arm] = {}
            self._changed(arm)
            self._pulls[arm] = 0
            self._probes[arm].reset(self.clock)

    # ---- logging and state ----------------------------------------------------------------
    def pulls(self) -> tuple[int, ...]:
        return tuple(self._pulls)

    def kept(self, arm: int) -> int:
        """Steps of ``arm`` the estimates rest on."""
        return sum(len(s) for s in self._steps[arm].values())

    def largest_running(self) -> int:
        return max((r for arm in self._steps for s in arm.values() for r, _, _ in s), default=1)

    def state_dict(self) -> dict[str, Any]:
        return {"num_arms": self.num_arms, "window": self.window, "pulls": list(self._pulls), "clock": self.clock,
                "stale": list(self._stale),
                "steps": [[[r, t, s] for key in sorted(arm) for r, t, s in arm[key]] for arm in self._steps],
                "probes": [p.state_dict() for p in self._probes],
                "fits": [f.state_dict() for f in self._fits], "pooled": self._pooled.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"arm costs state must be a dict, got {type(state).__name__}")
        for key, mine in (("num_arms", self.num_arms), ("window", self.window)):
            if state.get(key) != mine:
                raise ValueError(f"arm costs state '{key}'={state.get(key)!r} does not match this policy's {mine!r}")
        na = self.num_arms
        for key in ("pulls", "steps", "probes", "fits"):
            if not isinstance(state.get(key), list) or len(state[key]) != na:
                raise ValueError(f"arm costs state '{key}' must hold one entry per arm ({na})")
        check_int("arm costs state 'clock'", state.get("clock"), 0)
        stale = state.get("stale")
        if not (isinstance(stale, list) and len(stale) == na and all(isinstance(x, bool) for x in stale)):
            raise ValueError(f"arm costs state 'stale' must hold one bool per arm ({na}), got {stale!r}")
        steps: list[dict[int, deque]] = []
        for a, arm in enumerate(state["steps"]):
            check_int(f"arm costs state 'pulls'[{a}]", state["pulls"][a], 0)
            by_octave: dict[int, deque] = {}
            for e in arm if isinstance(arm, list) else [None]:
                if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], int) and e[0] >= 1
                        and isinstance(e[1], int) and e[1] >= 0 and isinstance(e[2], (int, float)) and e[2] > 0):
                    raise ValueError(f"arm costs state 'steps'[{a}] must hold [running >= 1, tokens >= 0, "
                                     f"seconds > 0] triples, got {e!r}")
                by_octave.setdefault(octave(e[0]), deque(maxlen=self.window)).append((e[0], e[1], float(e[2])))
            steps.append(by_octave)
        for a in range(na):
            self._probes[a].load_state_dict(state["probes"][a], f"arm costs state 'probes'[{a}]")
        for fit, s in zip(self._fits, state["fits"]):
            fit.load_state_dict(s)
        self._pooled.load_state_dict(state.get("pooled"))
        self._steps, self._pulls, self.clock = steps, list(state["pulls"]), state["clock"]
        for arm in range(na):
            self._changed(arm)
        self._stale = list(stale)
