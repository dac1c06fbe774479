"""How much a per-bucket choice of tree shape could gain over the best fixed arm.

From the step traces of fixed-arm runs over the same rollout: the decode-step seconds
each arm spent in each batch-size bucket, and what picking the fastest arm in every
bucket would sum to (an oracle that needs no exploration). It is an estimate: an arm
that emits more tokens per step moves through the buckets in fewer steps, so the
work done inside a bucket is similar across arms, not identical.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from nemo_tlt.rollout.protocol import StepTrace


def bucket_seconds(trace: Sequence[StepTrace], bucket_of: Callable[[int], int]) -> dict[int, float]:
    """Decode-step seconds per bucket of the running batch size."""
    out: dict[int, float] = {}
    for step in trace:
        b = bucket_of(step.running)
        out[b] = out.get(b, 0.0) + step.seconds
    return out


def per_bucket_oracle(traces: Mapping[str, Sequence[StepTrace]], bucket_of: Callable[[int], int]) -> dict:
    """{"oracle_steps_s", "best_fixed", "best_fixed_steps_s", "oracle_vs_best_fixed",
    "best_per_bucket": {bucket: arm}} over the given fixed-arm traces (arm name -> trace)."""
    if not traces:
        raise ValueError("per_bucket_oracle: no fixed-arm traces given")
    per_arm = {name: bucket_seconds(tr, bucket_of) for name, tr in traces.items()}
    buckets = sorted({b for secs in per_arm.values() for b in secs})
    # Only arms that decoded in a bucket compete there: an arm that skipped a bucket
    # (its rows finished across it in one step) did that bucket's work elsewhere.
    best_per_bucket = {b: min((a for a in per_arm if b in per_arm[a]), key=lambda a: per_arm[a][b])
                       for b in buckets}
    oracle = sum(per_arm[a][b] for b, a in best_per_bucket.items())
    totals = {a: sum(secs.values()) for a, secs in per_arm.items()}
    best = min(totals, key=totals.get)
    if totals[best] < oracle:  # one arm throughout is itself a per-bucket choice
        oracle, best_per_bucket = totals[best], {b: best for b in buckets}
    return {"oracle_steps_s": oracle, "best_fixed": best, "best_fixed_steps_s": totals[best],
            "oracle_vs_best_fixed": oracle / totals[best] if totals[best] > 0 else 1.0,
            "best_per_bucket": best_per_bucket}
