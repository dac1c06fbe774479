"""Where a worker's rollout decoded plainly and where with SD: a compact run-length
list of decode segments for the worker timeline plot.

Contract
--------
``decode_segments(trace, prefill_s, wall_s, start)`` turns one ``generate`` call's
step trace (``GenerationStats.trace``: one ``StepTrace`` per decode step, in order)
into ``[start_s, end_s, choice]`` segments, ``choice`` being ``"plain"`` or the tree
shape's name. Consecutive steps with the same choice are one segment. Times are on
the caller's clock: ``start`` is when ``generate`` was called, the decode steps
begin after the prefill (``prefill_s``) and end at ``start + wall_s``. The engine
times each step but not the short bookkeeping between steps (retiring finished rows,
the policy's choice), so that remainder is spread evenly over the steps: segments
are contiguous and lie within [start + prefill_s, start + wall_s].

At most ``max_segments`` segments are kept: while there are more, the shortest one
is merged into its longer neighbour (a plot cannot show a flicker finer than that).
"""
from __future__ import annotations

from nemo_tlt.rollout.protocol import StepTrace

PLAIN = "plain"
MAX_SEGMENTS = 48


def decode_segments(trace: list[StepTrace], prefill_s: float, wall_s: float, start: float,
                    max_segments: int = MAX_SEGMENTS) -> list[list]:
    """Run-length [start_s, end_s, choice] segments of one rollout (see the module docstring)."""
    if max_segments < 1:
        raise ValueError(f"decode_segments.max_segments must be >= 1, got {max_segments}")
    if not trace:
        return []
    gap = max(wall_s - prefill_s - sum(s.seconds for s in trace), 0.0) / len(trace)
    segs: list[list] = []
    t = start + prefill_s
    for step in trace:
        choice = step.shape or PLAIN
        end = t + step.seconds + gap
        if segs and segs[-1][2] == choice:
            segs[-1][1] = end
        else:
            segs.append([t, end, choice])
        t = end
    return cap_segments(segs, max_segments)


def cap_segments(segs: list[list], max_segments: int) -> list[list]:
    """Merge the shortest segment into its longer neighbour until at most `max_segments`
    remain; runs of one choice that meet are joined."""
    segs = [list(s) for s in segs]
    while len(segs) > max_segments:
        i = min(range(len(segs)), key=lambda k: segs[k][1] - segs[k][0])
        left = segs[i - 1] if i > 0 else None
        right = segs[i + 1] if i + 1 < len(segs) else None
        if right is None or (left is not None and left[1] - left[0] >= right[1] - right[0]):
            left[1] = segs[i][1]
            j = i - 1
        else:
            right[0] = segs[i][0]
            j = i + 1
        del segs[i]
        j = j if j < i else j - 1  # the neighbour's index after the deletion
        for k in (j, j - 1):  # join the merged neighbour with an equal choice beside it
            if 0 <= k < len(segs) - 1 and segs[k][2] == segs[k + 1][2]:
                segs[k][1] = segs[k + 1][1]
                del segs[k + 1]
    return segs
