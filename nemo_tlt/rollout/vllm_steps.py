"""One rollout on vLLM, one scheduler step at a time, under a TLT SD policy.

`run_steps` adds the requests to an in-process ``LLMEngine`` (``DELTA`` outputs) and
steps it until every request has finished. Before each step the SD policy chooses for
the running batch (``policy.choose(running)``), and the draft length it implies is
written to vLLM's scheduler for that step (``set_draft_len``: every batch size gets it,
so the step runs with exactly that length); after the step the policy observes the
tokens it produced and its time, as on the embedded engine. Each request's result goes
to ``on_result`` the step it finishes.

What a step's choice governs: vLLM verifies in step t the drafts proposed at the end of
step t-1, and proposes at the end of step t as many as step t's draft length. A step is
steady when it verifies the draft length it proposes: its cost is that choice's whole cost
(verify and draft at that length), and only steady steps are observed, as the choice that
ran (what the trace names). A step that changes the draft length mixes two choices and is
not observed; the new choice is then held for the next step without asking the policy
(that step is steady), so every choice the policy makes gets measured. Steps that prefill
(a request's first token) are not observed either (the embedded engine chooses after its
prefill). The learned policy does not record the first speculative step after plain ones
(`LearnedSDPolicy`'s catch-up rule) and asks for that tree once more.

A shape drafts a chain of its depth (vLLM's EAGLE-3 has no tree), clipped to the
engine's ``num_speculative_tokens``; the trace names what ran (``"{k}_1_{k}"``), the
policy observes the shape it chose.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.rollout.protocol import GenerationStats, RequestResult, StepTrace
from nemo_tlt.speculative.tree_shape import TreeShape


def draft_len(shape: TreeShape | None, max_draft_len: int) -> int:
    """vLLM's draft length for a policy's choice: 0 for plain, else the shape's depth clipped."""
    return 0 if shape is None else min(shape.depth, max_draft_len)


@dataclass
class _Row:
    """One request's output so far (vLLM sends deltas)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    started: bool = False


@dataclass
class StepControl:
    """What `run_steps` needs besides vLLM: the policy (None: plain), the engine's longest
    draft, whether a drafter is loaded, the scheduler write, and the batch limit. ``choose``
    (None: ``policy.choose``) is the step's choice for a running batch; a tensor-parallel
    engine passes TP rank 0's choice, broadcast, with ``policy`` (observed) on rank 0 only."""
    policy: SpecPolicy | None
    max_draft_len: int
    drafter_loaded: bool
    set_draft_len: Callable[[int], None] | None   # None: the engine was built without a drafter
    max_running: int
    choose: Callable[[int], TreeShape | None] | None = None

    def choice(self, running: int) -> TreeShape | None:
        if self.choose is not None:
            return self.choose(running)
        return self.policy.choose(running) if self.policy is not None else None


def run_steps(engine: Any, ids: Sequence[str], control: StepControl,
              finish: Callable[[int, list[int], str | None, list[Any], Any], RequestResult],
              on_result: Callable[[int, RequestResult], None]) -> GenerationStats:
    """Step ``engine`` (vLLM's ``LLMEngine``, the requests ``ids`` already added, ``ids[i]``
    being request i) until all finish. ``finish(i, tokens, finish_reason, logprobs,
    completion)`` builds request i's result from its whole output (``completion``: its last
    ``CompletionOutput``, for its speculative-decoding metrics); ``on_result(i, result)`` gets
    it at once. Returns the stats of the call: tokens, per-step trace, steps by kind,
    ``prefill_s`` (the steps that prefilled) and ``wall_s``; accepted lengths are the caller's
    (vLLM counts them per request)."""
    index = {rid: i for i, rid in enumerate(ids)}
    rows = [_Row() for _ in ids]
    stats, unfinished = GenerationStats(), len(ids)
    verified: TreeShape | None = None  # the choice whose drafts the next step verifies
    shape, hold = None, False  # hold: the last step changed the draft length; run its choice again
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = max(1, min(unfinished, control.max_running))
        if not hold:
            shape = control.choice(running)
        k = draft_len(shape, control.max_draft_len)
        if k and not control.drafter_loaded:
            raise ValueError(f"generate: the policy chose tree shape {shape.name} but no drafter is loaded "
                             "(load_drafter(...) first, or pass policy=None for plain decoding)")
        if control.set_draft_len is not None:
            control.set_draft_len(k)
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        made, prefilled = 0, False
        for out in outputs:
            i, completion = index[out.request_id], out.outputs[0]
            row = rows[i]
            prefilled |= not row.started
            row.started = True
            row.tokens += completion.token_ids
            row.logprobs += completion.logprobs or []
            made += len(completion.token_ids)
            if out.finished:
                unfinished -= 1
                on_result(i, finish(i, row.tokens, completion.finish_reason, row.logprobs, completion))
        stats.tokens_generated += made
        stats.target_forwards += 1
        ran = draft_len(verified, control.max_draft_len)
        if prefilled:
            stats.prefill_forwards += 1
            stats.prefill_s += dt
        else:
            if ran:
                stats.sd_steps += 1
            else:
                stats.plain_steps += 1
            stats.trace.append(StepTrace(running, TreeShape(ran, 1, ran).name if ran else None, made, made / running, dt))
            if control.policy is not None and made and ran == k:
                control.policy.observe(running, verified, made, dt)
        hold = ran != k
        verified = shape if k else None
    stats.wall_s = time.perf_counter() - t_start
    stats.time_other_s = stats.wall_s
    return stats
