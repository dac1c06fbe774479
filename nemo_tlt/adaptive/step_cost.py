"""How an SD step's time grows with the running batch size, fitted online.

Within one bandit bucket the running batch shrinks as rows finish (from 64 to 16 in
the top bucket of the default long-tail rollout), so a reward that depends on the
batch size ranks arms by *when* they were pulled as much as by what they do. If a
step of arm a at batch r takes t = c_a * r**b and keeps acc_a tokens per row, then
its throughput is tokens / t = acc_a * r**(1 - b) / c_a, and

    (tokens / t) / r**(1 - b) = accepted length per row / c_a

does not depend on r: arms compare on what they control. ``b = 0`` (a fixed cost per
step, overhead-bound decoding) makes that the "per_row" reward, ``b = 1``
(compute-bound: time grows like the batch) plain "throughput"; real decoding lies
in between (figures: docs/benchmarks.md). :class:`StepCostFit` estimates b as the pooled within-group
least-squares slope of log(seconds) on log(running): each group (an arm, or a
bucket) has its own cost level as intercept, so groups pulled at different batch
sizes do not bias the slope. Consumers apply the current b when they rank, to every
stored reward alike: the first steps of a rollout all run in the crowded head, so an
early b can be far from the later one, and rewards scaled once with it would keep
that error until they left their window.
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

    def fitted(self) -> float | None:
        """The fitted b clamped to [0, 1], or None while the batch sizes have not spread."""
        slope, spread = pooled_slope(self._stats)
        if spread < MIN_SPREAD:
            return None
        return min(1.0, max(0.0, slope))

    def exponent(self) -> float:
        """The fitted b, or the prior while there is too little spread to fit it."""
        fitted = self.fitted()
        return self.prior if fitted is None else fitted

    def state_dict(self) -> dict[str, Any]:
        return {"stats": {k: list(v) for k, v in self._stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stats = state.get("stats") if isinstance(state, dict) else None
        if not isinstance(stats, dict) or not all(
                isinstance(v, list) and len(v) == 5 and all(isinstance(x, (int, float)) for x in v)
                for v in stats.values()):
            raise ValueError("step-cost state must be a dict with 'stats': {arm: [n, sx, sy, sxx, sxy]}")
        self._stats = {str(k): [float(x) for x in v] for k, v in stats.items()}


def throughput_at(tokens_per_s: float, running: int, reference: int, b: float) -> float:
    """What a step that made ``tokens_per_s`` at batch ``running`` would make at batch
    ``reference`` if its time grows like running**b: throughput scales as r**(1 - b)."""
    return tokens_per_s * (reference / running) ** (1.0 - b)
