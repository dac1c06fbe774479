"""Noticing that the drafter's drafts are being rejected, and when to look again.

A drafter that is untrained (every run starts with one unless it was trained ahead)
or stale (the policy moved since it was trained) keeps about one token per row per SD
step: the target's own token and nothing of the draft. Every SD step then costs a
draft and a tree verification for what a plain step gives. :class:`CollapseGuard`
watches the accepted length per row of the SD steps that ran (a count, never the
tokens): once the tokens kept per row, pooled over the last ``steps`` of them (or over
fewer, as soon as they hold ``rows`` rows: one step of a crowded batch is already
plenty of evidence, and in the head it is the dearest to repeat), fall below
``min_accept`` the drafter counts as collapsed and the policy decodes plainly, probing one SD step when
the :class:`~nemo_tlt.adaptive.backoff.Backoff` says so. A probe that accepts at
least ``min_accept`` ends the collapse; one that does not doubles the wait. A new
drafter (idle-time training, a refit) restarts the wait from the shortest, so a
retrained drafter is picked up within ``shortest`` steps.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from nemo_tlt.adaptive.backoff import Backoff
from nemo_tlt.checks import check_float, check_int


class CollapseGuard:
    """Collapse state from the accepted lengths per row of recent SD steps."""

    def __init__(self, min_accept: float, steps: int, rows: int, shortest: int, longest: int) -> None:
        check_float("CollapseGuard.min_accept", min_accept, 1.0)
        check_int("CollapseGuard.steps", steps, 1)
        check_int("CollapseGuard.rows", rows, 1)
        self.min_accept, self.steps, self.rows = float(min_accept), steps, rows
        self.backoff = Backoff(shortest, longest)
        self.collapsed = False
        self.clock = 0  # decode steps seen (choose calls)
        self.collapses = 0  # times the drafter was found collapsed (for logs)
        self._recent: deque[tuple[float, int]] = deque(maxlen=steps)  # (kept per row, rows)

    def tick(self) -> None:
        self.clock += 1

    def probe_due(self) -> bool:
        """Whether a collapsed drafter should be tried again at this step."""
        return self.collapsed and self.backoff.due(self.clock)

    def record(self, accept_per_row: float, rows: int = 1) -> str | None:
        """Accepted length per row of an SD step that ran over ``rows`` rows. Returns
        "collapsed" or "recovered" when the state changes, else None."""
        if self.collapsed:  # only probes run SD while collapsed
            if accept_per_row >= self.min_accept:
                self.collapsed = False
                self._recent.clear()
                self._recent.append((accept_per_row, rows))
                return "recovered"
            self.backoff.failed(self.clock)
            return None
        self._recent.append((accept_per_row, rows))
        seen = sum(n for _, n in self._recent)
        enough = len(self._recent) == self.steps or seen >= self.rows
        if enough and sum(a * n for a, n in self._recent) / seen < self.min_accept:
            self.collapsed = True
            self.collapses += 1
            # A drafter that collapsed before waits longer this time (the wait only
            # shrinks when the drafter changes).
            self.backoff.failed(self.clock)
            return "collapsed"
        return None

    def drafter_changed(self) -> None:
        """New drafter weights: forget its predecessor's record, probe it soon."""
        self._recent.clear()
        self.backoff.reset(self.clock)

    def state_dict(self) -> dict[str, Any]:
        return {"collapsed": self.collapsed, "clock": self.clock, "collapses": self.collapses,
                "recent": [[a, n] for a, n in self._recent], "backoff": self.backoff.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("collapsed"), bool):
            raise ValueError("collapse state must be a dict with 'collapsed' (bool), 'clock', 'collapses', "
                             "'recent' and 'backoff'")
        check_int("collapse state 'clock'", state.get("clock"), 0)
        check_int("collapse state 'collapses'", state.get("collapses"), 0)
        recent = state.get("recent")
        if not isinstance(recent, list) or len(recent) > self.steps or not all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], (int, float)) and not isinstance(x[0], bool)
                and isinstance(x[1], int) and not isinstance(x[1], bool) and x[1] >= 1 for x in recent):
            raise ValueError(f"collapse state 'recent' must be a list of at most {self.steps} [kept per row, "
                             f"rows >= 1] pairs, got {recent!r}")
        self.backoff.load_state_dict(state.get("backoff"), "collapse state 'backoff'")
        self.collapsed, self.clock, self.collapses = state["collapsed"], state["clock"], state["collapses"]
        self._recent = deque(((float(a), n) for a, n in recent), maxlen=self.steps)
