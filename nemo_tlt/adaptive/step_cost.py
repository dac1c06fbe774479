"""How an SD step's time grows with the running batch size, fitted online.

Within one bandit bucket the running batch shrinks as rows finish (from 64 to 16 in
the top bucket of the default long-tail rollout), so a reward that depends on the
batch size ranks arms by *when* they were pulled as much as by what they do. If a
step of arm a at batch r takes t = c_a * r**b, then

    tokens / t / r**b = accepted length per row / c_a

does not depend on r: arms compare on what they control. ``b = 1`` (compute-bound
decoding) gives the "per_row" reward, ``b = 0`` (a fixed cost per step) gives
"throughput"; on the 2-core CPU b was about 0.33. :class:`StepCostFit` estimates b
as the pooled within-arm least-squares slope of log(seconds) on log(running): each
arm's own cost level c_a is its intercept, so arms pulled at different batch sizes
do not bias the slope. The bandit applies the current b when it ranks, to every
reward in its windows alike (BegMab.size_exponent): on the default long-tail
benchmark b read 0.78 after 10 steps (all in the crowded head), 0.26 at the end of
the first rollout and 0.31-0.32 after the next two, and rewards scaled once with the
early b would have kept that error until they left their window.
"""
from __future__ import annotations

import math
from typing import Any

# Below this pooled spread of log(running) (summed squared deviations) the slope is
# not trusted and the prior is used: e.g. 4 steps at batch sizes 16 and 32 give 0.48.
MIN_SPREAD = 0.5


def pooled_slope(stats: dict[str, list[float]]) -> tuple[float, float]:
    """(slope, spread) of the pooled within-group regression of y on x, from per-group
    sums [n, sx, sy, sxx, sxy]. spread = sum of within-group squared x deviations."""
    num = den = 0.0
    for n, sx, sy, sxx, sxy in stats.values():
        if n < 2:
            continue
        den += sxx - sx * sx / n
        num += sxy - sx * sy / n
    return (num / den if den > 0 else 0.0), den


class StepCostFit:
    """Online estimate of b in step seconds ~ c_arm * running**b, clamped to [0, 1]."""

    def __init__(self, prior: float = 0.5) -> None:
        if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0.0 <= prior <= 1.0:
            raise ValueError(f"StepCostFit.prior must be a number in [0, 1], got {prior!r}")
        self.prior = float(prior)
        self._stats: dict[str, list[float]] = {}

    def add(self, arm: str, running: int, seconds: float) -> None:
        x, y = math.log(running), math.log(seconds)
        s = self._stats.setdefault(arm, [0.0, 0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] += v

    def exponent(self) -> float:
        slope, spread = pooled_slope(self._stats)
        if spread < MIN_SPREAD:
            return self.prior
        return min(1.0, max(0.0, slope))

    def state_dict(self) -> dict[str, Any]:
        return {"stats": {k: list(v) for k, v in self._stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stats = state.get("stats") if isinstance(state, dict) else None
        if not isinstance(stats, dict) or not all(
                isinstance(v, list) and len(v) == 5 and all(isinstance(x, (int, float)) for x in v)
                for v in stats.values()):
            raise ValueError("step-cost state must be a dict with 'stats': {arm: [n, sx, sy, sxx, sxy]}")
        self._stats = {str(k): [float(x) for x in v] for k, v in stats.items()}
