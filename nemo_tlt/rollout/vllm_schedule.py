"""TLT's SD decisions as vLLM's per-batch-size draft lengths, as pure functions.

vLLM 0.32 decides the draft length of each scheduler step from the number of running
requests alone, through a dense lookup built from
``speculative_config["num_speculative_tokens_per_batch_size"]``: inclusive
``(first, last, k)`` batch-size ranges, the first starting at 1, ``k = 0`` a plain step,
gaps and the tail carrying the previous ``k``, every ``k`` clipped to
``num_speculative_tokens`` (``v1/spec_decode/dynamic/utils.py``). TLT's "speculate in
the long tail only" is such a schedule.

What a policy maps to is `trtllm_schedule.draft_lengths` (the same reading between
rollouts: the learned policy's best estimate per batch size, the adaptive policy's
threshold and greedy arm, a fixed shape's depth; a shape maps to its depth, since
vLLM's EAGLE-3 drafts a chain).
"""
from __future__ import annotations

from collections.abc import Sequence

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.checks import check_int
from nemo_tlt.rollout.trtllm_schedule import draft_lengths

Schedule = list[tuple[int, int, int]]


def ranges(lengths: Sequence[int]) -> Schedule:
    """Per-batch-size draft lengths (index b-1, b = 1..len) as vLLM's ranges: one
    ``(first, last, k)`` per run of equal lengths, covering 1..len(lengths) exactly."""
    if not lengths:
        raise ValueError("lengths: at least one batch size is needed")
    out: Schedule = []
    for b, k in enumerate(lengths, start=1):
        check_int(f"lengths[{b - 1}]", k, 0)
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return out


def dense_lookup(schedule: Schedule, max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """The scheduler's lookup for ``schedule`` (index = batch size, index 0 unused), as
    vLLM builds it for ranges that cover 1..max_num_seqs with no gap."""
    check_int("max_num_seqs", max_num_seqs, 1)
    check_int("num_speculative_tokens", num_speculative_tokens, 1)
    dense = [0] * (max_num_seqs + 1)
    expected = 1
    for first, last, k in schedule:
        if first != expected or last < first:
            raise ValueError(f"schedule: range ({first}, {last}, {k}) does not continue from batch size {expected}")
        for b in range(first, min(last, max_num_seqs) + 1):
            dense[b] = min(k, num_speculative_tokens)
        expected = last + 1
    if expected <= max_num_seqs:
        raise ValueError(f"schedule: batch sizes {expected}..{max_num_seqs} are not covered")
    return dense


def policy_schedule(policy: SpecPolicy | None, num_speculative_tokens: int, max_num_seqs: int) -> Schedule:
    """The ranges to install before a rollout under ``policy`` (None: plain everywhere)."""
    return ranges(draft_lengths(policy, num_speculative_tokens, max_num_seqs))


def start_schedule(num_speculative_tokens: int, max_num_seqs: int) -> Schedule:
    """The schedule vLLM is built with: every draft length 0..num_speculative_tokens on
    some batch size (a CUDA-graph capture follows the start-up schedule; it then holds each
    query length, though only up to the widest batch using it at start-up), the full length
    above. Replaced before the first rollout."""
    lengths = list(range(num_speculative_tokens, -1, -1))[:max_num_seqs]
    lengths += [num_speculative_tokens] * (max_num_seqs - len(lengths))
    return ranges(lengths)
