"""What each decoding choice has cost, per batch-size bucket, and which to make next.

Arms are indices: 0 is plain decoding, 1..K the tree shapes (the policy maps them).
Buckets are as in :class:`~nemo_tlt.adaptive.bandit.BanditConfig`: edges
``(e0, ..., en-1)`` make buckets ``[1, e0)``, ``[e0, e1)``, ..., ``[en-1, inf)``.

Measure. Each step stores its throughput (tokens kept / seconds) with its batch size
r_i. An arm's estimate at the current batch size r is the median over its bucket
window of ``throughput_i * (r / r_i) ** (1 - b_arm)``: the throughput each of its
steps would have had at r if a step's time grows like r**b_arm (see step_cost.py).
Comparing arms at the batch size being decided, rather than at whatever batch sizes
they happened to be pulled at, is what makes pulls early and late in a bucket (the
batch shrinks as rows finish) comparable, and plain decoding and a wide tree may
grow differently with the batch (a tree verifies r x nodes tokens), hence one b per
arm: fitted on that arm's steps, with each bucket its own cost level (acceptance
differs between the crowded head and the tail), else pooled over arms, else 0.5.
The median shrugs off a slow step (a page fault, a preemption).

Choice, in a bucket: first every arm ``min_pulls`` times (the least-pulled next,
ties to the lowest index, so plain first), except arms that the neighbouring buckets
already show to be clearly worse (their estimate there, moved to this batch size,
below ``1 - skip_margin`` of the best one's): a bucket visited once per rollout
(the first step, all rows running) would otherwise spend several rollouts pulling
arms known to lose; skipped arms are still probed on back-off. Then the arm with the
best estimate,
except that each other arm is probed once when its
:class:`~nemo_tlt.adaptive.backoff.Backoff` (counted in the bucket's own steps) is
due, and each probe doubles its wait. An arm that loses keeps being probed less and
less often (exploration costs about the sum of 1 / wait); when the best arm changes,
the one it displaced is probed again soon. No randomness: the same steps and timings
give the same choices.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Any, Iterable, Sequence

import numpy as np

from nemo_tlt.adaptive.backoff import Backoff
from nemo_tlt.adaptive.step_cost import StepCostFit, throughput_at
from nemo_tlt.checks import check_float, check_int


class ArmTable:
    """Per-bucket windows of (throughput, batch size), pull counts and probe back-offs."""

    def __init__(self, num_arms: int, bucket_edges: Sequence[int], window: int, min_pulls: int,
                 probe_shortest: int, probe_longest: int, skip_margin: float = 0.2) -> None:
        check_int("ArmTable.num_arms", num_arms, 1)
        check_int("ArmTable.window", window, 1)
        check_int("ArmTable.min_pulls", min_pulls, 1, window)
        self.num_arms, self.edges = num_arms, np.asarray(tuple(bucket_edges))
        check_float("ArmTable.skip_margin", skip_margin, 0.0, 1.0)
        self.window, self.min_pulls, self.skip_margin = window, min_pulls, float(skip_margin)
        self.num_buckets = len(self.edges) + 1
        nb, na = self.num_buckets, num_arms
        self._windows: list[list[deque[tuple[float, int]]]] = [
            [deque(maxlen=window) for _ in range(na)] for _ in range(nb)]
        self._pulls = [[0] * na for _ in range(nb)]
        self._clock = [0] * nb
        self._greedy: list[int | None] = [None] * nb
        self._probes = [[Backoff(probe_shortest, probe_longest) for _ in range(na)] for _ in range(nb)]
        self._fits = [StepCostFit() for _ in range(na)]  # groups: buckets
        self._pooled = StepCostFit()  # groups: arms

    def bucket_of(self, running: int) -> int:
        return int(np.searchsorted(self.edges, running, side="right"))

    # ---- estimates ------------------------------------------------------------
    def exponent(self, arm: int) -> float:
        """b of step time ~ running**b for ``arm``: its own fit, else pooled, else the prior."""
        own = self._fits[arm].fitted()
        if own is not None:
            return own
        return self._pooled.exponent()

    def pooled_exponent(self) -> float:
        """b pooled over every arm (each arm its own cost level)."""
        return self._pooled.exponent()

    def estimate(self, bucket: int, arm: int, running: int) -> float | None:
        """Median throughput of the arm's window in ``bucket``, moved to batch ``running``."""
        window = self._windows[bucket][arm]
        if not window:
            return None
        b = self.exponent(arm)
        return statistics.median(throughput_at(tps, r, running, b) for tps, r in window)

    def neighbour_estimate(self, bucket: int, arm: int, running: int) -> float | None:
        """The arm's median throughput over the windows of the adjacent buckets, moved to
        batch ``running``; None if it ran in neither."""
        b = self.exponent(arm)
        pooled = [throughput_at(tps, r, running, b) for nb in (bucket - 1, bucket + 1)
                  if 0 <= nb < self.num_buckets for tps, r in self._windows[nb][arm]]
        return statistics.median(pooled) if pooled else None

    def _still_to_pull(self, bucket: int, running: int) -> list[int]:
        """Arms below min_pulls here, less those the neighbours show clearly losing."""
        pulls = self._pulls[bucket]
        under = [a for a in range(self.num_arms) if pulls[a] < self.min_pulls]
        if not under:
            return []
        prior = {a: self.neighbour_estimate(bucket, a, running) for a in range(self.num_arms)}
        known = [v for v in prior.values() if v is not None]
        if not known:
            return under
        bar = (1.0 - self.skip_margin) * max(known)
        return [a for a in under if prior[a] is None or prior[a] >= bar]

    def best(self, bucket: int, running: int) -> int | None:
        """The arm with the best estimate at ``running`` (ties: lowest index); None if none tried."""
        best, value = None, -1.0
        for arm in range(self.num_arms):
            est = self.estimate(bucket, arm, running)
            if est is not None and est > value:
                best, value = arm, est
        return best

    # ---- choosing and recording ---------------------------------------------------------
    def choose(self, running: int) -> int:
        """The arm for a step at batch ``running`` (advances the bucket's step clock)."""
        bucket = self.bucket_of(running)
        self._clock[bucket] += 1
        now, pulls = self._clock[bucket], self._pulls[bucket]
        to_pull = self._still_to_pull(bucket, running)
        if to_pull:
            return min(to_pull, key=lambda a: (pulls[a], a))
        best = self.best(bucket, running)
        assert best is not None  # an arm that is not skipped was pulled
        previous = self._greedy[bucket]
        if previous is not None and previous != best:
            self._probes[bucket][previous].reset(now)  # displaced: check it again soon
        self._greedy[bucket] = best
        probes = self._probes[bucket]
        due = [a for a in range(self.num_arms) if a != best and probes[a].due(now)]
        if not due:
            return best
        arm = min(due, key=lambda a: (probes[a].next_at, a))
        probes[arm].failed(now)
        return arm

    def record(self, running: int, arm: int, tokens_per_s: float, seconds: float) -> None:
        bucket = self.bucket_of(running)
        self._windows[bucket][arm].append((float(tokens_per_s), int(running)))
        self._pulls[bucket][arm] += 1
        self._fits[arm].add(str(bucket), running, seconds)
        self._pooled.add(str(arm), running, seconds)

    def discount(self, arms: Iterable[int]) -> None:
        """Trust what ``arms`` measured half as much: each window keeps its newer half
        (at least one step) and each probe wait halves."""
        for bucket in range(self.num_buckets):
            for arm in arms:
                window = self._windows[bucket][arm]
                keep = list(window)[len(window) // 2:]
                self._windows[bucket][arm] = deque(keep, maxlen=self.window)
                self._probes[bucket][arm].halve(self._clock[bucket])

    def forget(self, arms: Iterable[int]) -> None:
        """Drop what ``arms`` measured (their windows and pull counts): they are tried
        afresh. Their step-time fits stay: timing does not depend on the drafter."""
        for bucket in range(self.num_buckets):
            for arm in arms:
                self._windows[bucket][arm].clear()
                self._pulls[bucket][arm] = 0
                self._probes[bucket][arm].reset(self._clock[bucket])

    # ---- logging and state ----------------------------------------------------------------
    def pulls(self, bucket: int) -> tuple[int, ...]:
        return tuple(self._pulls[bucket])

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_arms": self.num_arms, "bucket_edges": self.edges.tolist(), "window": self.window,
            "pulls": [list(p) for p in self._pulls], "clock": list(self._clock), "greedy": list(self._greedy),
            "windows": [[[[tps, r] for tps, r in w] for w in bucket] for bucket in self._windows],
            "probes": [[p.state_dict() for p in bucket] for bucket in self._probes],
            "fits": [f.state_dict() for f in self._fits], "pooled": self._pooled.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"arm table state must be a dict, got {type(state).__name__}")
        for key, mine in (("num_arms", self.num_arms), ("bucket_edges", self.edges.tolist()),
                          ("window", self.window)):
            if state.get(key) != mine:
                raise ValueError(f"arm table state '{key}'={state.get(key)!r} does not match this policy's {mine!r}")
        nb, na = self.num_buckets, self.num_arms
        for key in ("pulls", "windows", "probes"):
            grid = state.get(key)
            if not (isinstance(grid, list) and len(grid) == nb and all(isinstance(r, list) and len(r) == na
                                                                        for r in grid)):
                raise ValueError(f"arm table state '{key}' must be {nb} buckets x {na} arms")
        for key in ("clock", "greedy"):
            if not isinstance(state.get(key), list) or len(state[key]) != nb:
                raise ValueError(f"arm table state '{key}' must hold one entry per bucket ({nb})")
        windows = []
        for b, bucket in enumerate(state["windows"]):
            row = []
            for a, w in enumerate(bucket):
                if not all(isinstance(e, list) and len(e) == 2 and isinstance(e[1], int) and e[1] >= 1 for e in w):
                    raise ValueError(f"arm table state 'windows'[{b}][{a}] must hold [throughput, running >= 1] pairs")
                row.append(deque(((float(t), int(r)) for t, r in w), maxlen=self.window))
            windows.append(row)
        for b in range(nb):
            check_int(f"arm table state 'clock'[{b}]", state["clock"][b], 0)
            g = state["greedy"][b]
            if g is not None:
                check_int(f"arm table state 'greedy'[{b}]", g, 0, na - 1)
            for a in range(na):
                check_int(f"arm table state 'pulls'[{b}][{a}]", state["pulls"][b][a], 0)
                self._probes[b][a].load_state_dict(state["probes"][b][a], f"arm table state 'probes'[{b}][{a}]")
        fits = state.get("fits")
        if not isinstance(fits, list) or len(fits) != na:
            raise ValueError(f"arm table state 'fits' must hold one step-cost fit per arm ({na})")
        for fit, s in zip(self._fits, fits):
            fit.load_state_dict(s)
        self._pooled.load_state_dict(state.get("pooled"))
        self._windows, self._pulls = windows, [list(p) for p in state["pulls"]]
        self._clock, self._greedy = list(state["clock"]), list(state["greedy"])
