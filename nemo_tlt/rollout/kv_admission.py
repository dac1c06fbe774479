"""Which requests of a ``generate`` call the embedded engine decodes together under a KV budget
(``rollout.kv_cache_gib`` or ``rollout.kv_cache_fraction``, per rank, resolved to bytes for the
call: ``nemo_tlt.rollout.kv_limit``), by the rule of ``nemo_tlt.model.kv_budget``.

Without a budget all requests are one wave, decoded as the engine always has. With one, the
requests are taken in the engine's prefill order (by prompt length) and cut into consecutive
waves (``admission_waves``), each row needing its prompt plus ``max_new_tokens`` cache slots; the
engine decodes a wave to its end before it prefills the next and caps that wave's caches (target
and drafter) at ``slots_within(budget, rows of the wave, slot_bytes)`` slots per row, so their
growth (at least doubling, ``KVCache.reserve``) stops at the budget. A request that does not fit
alone is refused (``check_fits``) before any decoding.

What waves change: greedy rows and coupled rows (noise keyed by seed, sequence id and position;
a request without a ``seq_id`` keeps its index in the whole call) get the tokens they get in one
batch; rejection sampling draws from the call's one generator in batch order, so it samples the
same distribution but not the same tokens. Log-probs equal one batch's within fp32 rounding, not
bit for bit: a CPU matmul rounds a row differently with the number of rows beside it (so does the
unbounded engine as its batch shrinks). Trees that would run past a wave's capped cache are
replaced by plain steps (``TorchRolloutEngine._tree_fits``).
"""
from __future__ import annotations

from nemo_tlt.drafter.base import Drafter
from nemo_tlt.model.kv_budget import admission_waves, slots_within
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.kv_limit import KVBudget
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.row_batch import draft_kv_bytes
from nemo_tlt.speculative.sampling import SamplingParams


def engine_slot_bytes(target: DecoderLM, drafter: Drafter | None) -> int:
    """Bytes one cache slot of one row holds on this rank: the target's K and V (this rank's
    KV heads, the engine's compute dtype) and the drafter's state (``RowBatch.kv_bytes`` counts
    the same two)."""
    slot = target.new_cache(1, 1).nbytes()
    return slot + (draft_kv_bytes(drafter.init_state(1, 1)) if drafter is not None else 0)


def check_fits(requests: list[Request], sampling: SamplingParams, budget: KVBudget, slot_bytes: int) -> None:
    """A ValueError naming the budget's setting and the numbers if the longest request cannot
    be decoded alone within the budget."""
    i = max(range(len(requests)), key=lambda j: len(requests[j].prompt))
    prompt = len(requests[i].prompt)
    need, room = prompt + sampling.max_new_tokens, slots_within(budget.bytes, 1, slot_bytes)
    if need > room:
        raise ValueError(f"{budget.source} ({budget.bytes} B) holds {room} cache slots for one row "
                         f"at {slot_bytes} B per slot (target and drafter KV), but request {i} needs its prompt "
                         f"({prompt}) + sampling.max_new_tokens ({sampling.max_new_tokens}) = {need}: "
                         f"{budget.advice(need * slot_bytes)}, or shorten the request")


def admission(requests: list[Request], sampling: SamplingParams, budget: KVBudget | None,
              slot_bytes: int) -> list[list[int]]:
    """The waves, each a list of request indices (one wave of every request, in order, when
    they fit together or there is no budget)."""
    everything = [list(range(len(requests)))]
    if budget is None:
        return everything
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))  # the prefill's order
    needs = [len(requests[i].prompt) + sampling.max_new_tokens for i in order]
    waves = admission_waves(needs, budget.bytes, slot_bytes)
    return everything if len(waves) == 1 else [order[a:b] for a, b in waves]


def wave_requests(requests: list[Request], rows: list[int]) -> list[Request]:
    """The requests of one wave, each keeping its index in the whole call as its ``seq_id``
    where it has none (the coupled noise is keyed by it)."""
    return [requests[i] if requests[i].seq_id is not None else Request(requests[i].prompt, seq_id=i) for i in rows]


def wave_slots(budget: KVBudget | None, rows: int, slot_bytes: int) -> int | None:
    """The most cache slots per row a wave of ``rows`` rows may grow to (None: no budget)."""
    return None if budget is None else slots_within(budget.bytes, rows, slot_bytes)
