"""Exponential back-off: when to try again something that lost last time.

The learned SD policy uses it twice: to re-probe an arm that is not the greedy choice
of its bucket, and to re-probe speculation at all after the drafter's acceptance
collapsed. Each failed try doubles the wait up to ``longest``, so the share of steps
spent on tries that keep failing shrinks like 1 / wait, while a change (a retrained
drafter, a batch size where the ranking flips) is still noticed within ``longest``
steps. Time is a step counter the owner advances; nothing here reads a clock.
"""
from __future__ import annotations

from typing import Any

from nemo_tlt.checks import check_int


class Backoff:
    """Next step at which to try, and the current wait, in [shortest, longest]."""

    def __init__(self, shortest: int, longest: int, now: int = 0) -> None:
        check_int("Backoff.shortest", shortest, 1)
        check_int("Backoff.longest", longest, shortest)
        self.shortest, self.longest = shortest, longest
        self.wait = shortest
        self.next_at = now + shortest

    def due(self, now: int) -> bool:
        return now >= self.next_at

    def failed(self, now: int) -> None:
        """A try at ``now`` lost: wait twice as long before the next."""
        self.wait = min(2 * self.wait, self.longest)
        self.next_at = now + self.wait

    def reset(self, now: int) -> None:
        """Start over from the shortest wait (a change worth checking soon)."""
        self.wait = self.shortest
        self.next_at = now + self.shortest

    def halve(self, now: int) -> None:
        """Trust the last failures half as much: halve the wait, and bring the next try
        no later than ``now`` + the new wait."""
        self.wait = max(self.shortest, self.wait // 2)
        self.next_at = min(self.next_at, now + self.wait)

    def state_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "next_at": self.next_at}

    def load_state_dict(self, state: dict[str, Any], key: str = "backoff") -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{key} must be a dict with 'wait' and 'next_at', got {state!r}")
        check_int(f"{key}.wait", state.get("wait"), self.shortest, self.longest)
        check_int(f"{key}.next_at", state.get("next_at"))
        self.wait, self.next_at = state["wait"], state["next_at"]
