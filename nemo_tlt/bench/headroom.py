"""How much a per-bucket choice of tree shape could gain over the best fixed arm.

From the step traces of fixed-arm runs over the same rollout: the decode-step seconds
and tokens each arm spent in each batch-size bucket, and what the best fixed arm's
rollout would take if each bucket's work (the tokens that arm made there) ran at the
fastest arm's throughput in that bucket (an oracle that needs no exploration).

Why throughput, not seconds: the work inside a bucket differs between arms. Rows leave
the batch only between steps, so an arm that emits more tokens per step carries some
rows' last tokens into a smaller bucket, and a bucket of the crowded head holds one to
three steps whose tokens differ by the arm (traced: 668 against 1027 tokens at 128+ rows).
The sum of the fastest arm's seconds per bucket took, in each bucket, the arm that did
least work there: 0.90-0.95x the best fixed arm on the long-tail workloads where pricing
the same work at each arm's throughput gives 0.96-0.99x. It is still a minimum over noisy
per-bucket throughputs (one round), so it leans optimistic.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from nemo_tlt.rollout.protocol import StepTrace


def _per_bucket(trace: Sequence[StepTrace], bucket_of: Callable[[int], int], value: Callable[[StepTrace], float]):
    out: dict[int, float] = {}
    for step in trace:
        b = bucket_of(step.running)
        out[b] = out.get(b, 0) + value(step)
    return out


def bucket_seconds(trace: Sequence[StepTrace], bucket_of: Callable[[int], int]) -> dict[int, float]:
    """Decode-step seconds per bucket of the running batch size."""
    return _per_bucket(trace, bucket_of, lambda step: step.seconds)


def bucket_tokens(trace: Sequence[StepTrace], bucket_of: Callable[[int], int]) -> dict[int, int]:
    """Tokens emitted per bucket of the running batch size."""
    return _per_bucket(trace, bucket_of, lambda step: step.tokens)


def per_bucket_oracle(traces: Mapping[str, Sequence[StepTrace]], bucket_of: Callable[[int], int],
                      reference: str | None = None) -> dict:
    """{"oracle_steps_s", "best_fixed", "best_fixed_steps_s", "oracle_vs_best_fixed",
    "best_per_bucket": {bucket: arm}} over the given fixed-arm traces (arm name -> trace):
    the ``reference`` arm's tokens in each bucket (default: the arm with the least step
    seconds, the best fixed arm) at the fastest arm's tokens per second there.
    "best_fixed" names the reference, whether or not it is the fastest arm throughout; a
    bucket where it made no tokens (or no arm measured any time) keeps its own seconds."""
    if not traces:
        raise ValueError("per_bucket_oracle: no fixed-arm traces given")
    if reference is not None and reference not in traces:
        raise ValueError(f"per_bucket_oracle: reference {reference!r} is not one of the traces {sorted(traces)}")
    seconds = {name: bucket_seconds(tr, bucket_of) for name, tr in traces.items()}
    tokens = {name: bucket_tokens(tr, bucket_of) for name, tr in traces.items()}
    totals = {a: sum(secs.values()) for a, secs in seconds.items()}
    best = min(totals, key=totals.get) if reference is None else reference

    def throughput(arm: str, b: int) -> float:
        return tokens[arm][b] / seconds[arm][b] if seconds[arm].get(b, 0.0) > 0.0 else 0.0

    # Only arms that decoded in a bucket compete there; the work priced is the reference's.
    best_per_bucket = {}
    for b in sorted(seconds[best]):
        fastest = max(traces, key=lambda a: (throughput(a, b), a == best))
        best_per_bucket[b] = fastest if tokens[best][b] > 0 and throughput(fastest, b) > 0 else best
    oracle = sum(tokens[best][b] / throughput(a, b) if a != best else seconds[best][b]
                 for b, a in best_per_bucket.items())
    return {"oracle_steps_s": oracle, "best_fixed": best, "best_fixed_steps_s": totals[best],
            "oracle_vs_best_fixed": oracle / totals[best] if totals[best] > 0 else 1.0,
            "best_per_bucket": best_per_bucket}
