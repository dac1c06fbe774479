"""A plan's per-rank, per-phase memory against a measurement of the same run.

Contract: ``compare_memory(predicted, measured, tolerance)`` is pure. ``predicted`` maps rank
-> phase -> term -> bytes (``nemo_tlt.plan.rank_memory.rank_phase_memory``), ``measured`` rank
-> phase -> peak bytes; both must name the same ranks and phases (a ``ValueError`` names what
differs). Per rank and phase: the predicted total, the measured peak, ``ratio`` = predicted /
measured, ``error`` = ratio - 1 and ``within`` = |error| <= tolerance (a measured 0 is within
only when the prediction is 0 too), plus the largest predicted term. Per phase: the worst
|error| over ranks and whether every rank is within; ``within_target``: every phase is.
"""
from __future__ import annotations

from typing import Mapping

TOLERANCE = 0.15


def _ratio(predicted: float, measured: float) -> float:
    if measured > 0:
        return predicted / measured
    return 1.0 if predicted == 0 else float("inf")


def compare_memory(predicted: Mapping[int, Mapping[str, Mapping[str, float]]],
                   measured: Mapping[int, Mapping[str, float]], tolerance: float = TOLERANCE) -> dict:
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if set(predicted) != set(measured):
        raise ValueError(f"ranks differ: predicted {sorted(predicted)}, measured {sorted(measured)}")
    phases = list(next(iter(predicted.values()), {}))
    per_rank: dict[int, dict[str, dict]] = {}
    for rank in sorted(predicted):
        if set(predicted[rank]) != set(measured[rank]) or set(predicted[rank]) != set(phases):
            raise ValueError(f"rank {rank}: phases differ: predicted {sorted(predicted[rank])}, "
                             f"measured {sorted(measured[rank])}")
        per_rank[rank] = {}
        for phase in phases:
            terms = predicted[rank][phase]
            total, got = float(sum(terms.values())), float(measured[rank][phase])
            ratio = _ratio(total, got)
            largest = max(terms.items(), key=lambda kv: kv[1])[0] if terms else None
            per_rank[rank][phase] = {"predicted_bytes": total, "measured_bytes": got, "ratio": round(ratio, 4),
                                     "error": round(ratio - 1, 4), "within": abs(ratio - 1) <= tolerance,
                                     "largest_term": largest}
    per_phase = {}
    for phase in phases:
        rows = [per_rank[r][phase] for r in per_rank]
        per_phase[phase] = {"worst_error": max((r["error"] for r in rows), key=abs),
                            "within": all(r["within"] for r in rows)}
    return {"tolerance": tolerance, "per_rank": per_rank, "per_phase": per_phase,
            "within_target": bool(per_phase) and all(p["within"] for p in per_phase.values())}
