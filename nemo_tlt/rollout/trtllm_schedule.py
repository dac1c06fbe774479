"""TLT's SD decisions as TensorRT-LLM's per-batch-size draft lengths, as pure functions.

TensorRT-LLM (LLM API, PyTorch backend; the version followed is named in
docs/trtllm.md) decides speculation per iteration from the active batch size
alone, through ``DecodingBaseConfig.draft_len_schedule``: a mapping from batch-size
thresholds to draft lengths where key ``k`` covers the batch sizes above the
previous key up to ``k`` inclusive, a length of 0 switches speculation off, and
batch sizes above the largest key do not speculate. ``max_concurrency=n`` is the
one-entry schedule ``{n: max_draft_len}``.

What carries over from a :class:`~nemo_tlt.adaptive.sd_policy.SpecPolicy`, read
between rollouts without side effects (no ``choose``, no exploration):

* ``AdaptiveSDPolicy``: SD on for batch sizes ``<= threshold_on``. The hysteresis
  (``threshold_off``) is not expressible: TensorRT-LLM decides from the batch size
  of each iteration, with no memory. Per bandit bucket the draft length is the depth
  of the bucket's greedy arm (the first arm while the bucket is untried). The
  bandit cannot explore inside TensorRT-LLM, and no per-step reward reaches it.
* ``LearnedSDPolicy``: the best estimate at each batch size (plain decoding is
  length 0; the first tree while nothing is measured); a collapsed drafter is all
  zeros; ``max_sd_running`` bounds.
* ``FixedSDPolicy``: its shape's depth everywhere (shape None: all zeros); None: all zeros.

A tree shape maps to its ``depth`` only: TensorRT-LLM's EAGLE-3 tree width
(``use_dynamic_tree``, ``dynamic_tree_max_topK``) is fixed when the LLM is built,
so ``topk`` and ``num_verify`` do not carry over. Depths above the engine's
``max_draft_len`` are clipped to it (the engine's buffers are sized by it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_tlt.adaptive.learned_policy import LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SpecPolicy
from nemo_tlt.checks import check_int
from nemo_tlt.speculative.tree_shape import TreeShape


def draft_lengths(policy: SpecPolicy | None, max_draft_len: int, max_batch_size: int) -> list[int]:
    """The draft length the policy would use at each batch size 1..max_batch_size
    (index b-1), clipped to ``max_draft_len``; 0 is plain decoding. A policy of a
    kind not listed in the module docstring is a ValueError naming its type."""
    check_int("max_draft_len", max_draft_len, 1)
    check_int("max_batch_size", max_batch_size, 1)
    sizes = range(1, max_batch_size + 1)
    if policy is None:
        shapes: list[TreeShape | None] = [None for _ in sizes]
    elif isinstance(policy, FixedSDPolicy):
        shapes = [policy.shape for _ in sizes]
    elif isinstance(policy, AdaptiveSDPolicy):
        shapes = [_adaptive_shape(policy, b) if b <= policy.config.threshold_on else None for b in sizes]
    elif isinstance(policy, LearnedSDPolicy):
        shapes = [policy.best_choice(b) for b in sizes]
    else:
        raise ValueError(f"policy: a {type(policy).__name__} cannot be mapped to TensorRT-LLM's "
                         "draft_len_schedule (AdaptiveSDPolicy, LearnedSDPolicy, FixedSDPolicy or None can)")
    return [0 if s is None else min(s.depth, max_draft_len) for s in shapes]


def compress_schedule(lengths: Sequence[int]) -> dict[int, int]:
    """TensorRT-LLM's ``draft_len_schedule`` for per-batch-size lengths (index b-1):
    one key per run of equal lengths (its last batch size), trailing zeros dropped
    (above the largest key speculation is off); ``{}`` means no speculation at all."""
    for i, n in enumerate(lengths):
        check_int(f"lengths[{i}]", n, 0)
    schedule: dict[int, int] = {}
    for b, n in enumerate(lengths, start=1):
        if b == len(lengths) or lengths[b] != n:
            schedule[b] = n
    while schedule and schedule[max(schedule)] == 0:
        del schedule[max(schedule)]
    return schedule


def draft_len_schedule(policy: SpecPolicy | None, max_draft_len: int, max_batch_size: int) -> dict[int, int]:
    """``compress_schedule(draft_lengths(...))``: the schedule to install before a rollout."""
    return compress_schedule(draft_lengths(policy, max_draft_len, max_batch_size))


def build_settings(policy: SpecPolicy | None, max_draft_len: int, max_batch_size: int) -> dict[str, Any]:
    """The `TRTLLMEngineConfig` settings that build the LLM with the policy's schedule:
    ``settings_for_schedule(draft_len_schedule(...))``."""
    return settings_for_schedule(draft_len_schedule(policy, max_draft_len, max_batch_size))


def settings_for_schedule(schedule: dict[int, int]) -> dict[str, Any]:
    """``max_draft_len``, ``draft_len_schedule`` and ``max_concurrency`` of a `TRTLLMEngineConfig`
    built with ``schedule``, under TensorRT-LLM's build-time rule: the smallest batch size's
    length is ``max_draft_len`` and none is longer. ``{}`` (plain decoding everywhere) has no
    such form: build without a drafter. A schedule whose longest draft is not at the smallest
    batch sizes is a ValueError."""
    if not schedule:
        raise ValueError("the policy never speculates: build the LLM without a drafter "
                         "(TRTLLMEngineConfig.drafter_dir null)")
    schedule = dict(sorted(schedule.items()))
    first = schedule[min(schedule)]
    if first == 0 or max(schedule.values()) > first:
        raise ValueError(f"the draft_len_schedule {schedule} is not expressible in TensorRT-LLM, which wants the "
                         "longest draft at the smallest batch sizes (the smallest key maps to max_draft_len)")
    return {"max_draft_len": first, "draft_len_schedule": schedule, "max_concurrency": None}


def same_schedule(a: dict[int, int], b: dict[int, int], max_batch_size: int) -> bool:
    """Whether two schedules give every batch size 1..max_batch_size the same draft length."""
    return all(schedule_length(a, n) == schedule_length(b, n) for n in range(1, max_batch_size + 1))


def schedule_length(schedule: dict[int, int], batch_size: int) -> int:
    """The draft length TensorRT-LLM uses at ``batch_size`` under ``schedule`` (its
    documented reading: the smallest key >= batch_size; none: 0)."""
    check_int("batch_size", batch_size, 1)
    keys = [k for k in sorted(schedule) if k >= batch_size]
    return schedule[keys[0]] if keys else 0


def _adaptive_shape(policy: AdaptiveSDPolicy, batch_size: int) -> TreeShape:
    if policy.fixed_shape is not None:
        return policy.fixed_shape
    assert policy.bandit is not None  # AdaptiveSDPolicy holds one or the other
    best = policy.bandit.bucket_stats(policy.bandit.bucket_of(batch_size)).best_arm
    return best if best is not None else policy.bandit.arms[0]

