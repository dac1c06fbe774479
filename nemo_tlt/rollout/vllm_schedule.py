"""vLLM's per-batch-size draft lengths, as pure functions.

vLLM 0.32 decides the draft length of each scheduler step from the number of running
requests alone, through a dense lookup built from
``speculative_config["num_speculative_tokens_per_batch_size"]``: inclusive
``(first, last, k)`` batch-size ranges, the first starting at 1, ``k = 0`` a plain step,
gaps and the tail carrying the previous ``k``, every ``k`` clipped to
``num_speculative_tokens`` (``v1/spec_decode/dynamic/utils.py``). The engine starts vLLM
with `start_schedule`, then writes the lookup before every step (`vllm_steps`): the SD
policy's choice for that step, at every batch size.
"""
from __future__ import annotations

from collections.abc import Sequence

from nemo_tlt.checks import check_int

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


def start_schedule(num_speculative_tokens: int, max_num_seqs: int) -> Schedule:
    """The schedule vLLM is built with: every draft length 0..num_speculative_tokens on
    some batch size (a CUDA-graph capture follows the start-up schedule; it then holds each
    query length, though only up to the widest batch using it at start-up), the full length
    above. Replaced before the first rollout."""
    lengths = list(range(num_speculative_tokens, -1, -1))[:max_num_seqs]
    lengths += [num_speculative_tokens] * (max_num_seqs - len(lengths))
    return ranges(lengths)
