"""The embedded engine's per-row decoding state (``RowBatch``): what it keeps for every
running row (see ``nemo_tlt.rollout.torch_engine``), grown in place as rows lengthen and
compacted as rows finish; every buffer lives on the engine's device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.drafter.base import DraftState
from nemo_tlt.model.kv_cache import KVCache, grow_slots, keep_rows


@dataclass
class RowBatch:
    rows: torch.Tensor          # [B] index of each running row in the request list
    seq_ids: torch.Tensor       # [B]
    prompt_len: torch.Tensor    # [B]
    lengths: torch.Tensor       # [B] committed length L (shared with cache.lengths values)
    num_gen: torch.Tensor       # [B] tokens generated so far
    tokens: torch.Tensor        # [B, C+1]
    features: torch.Tensor      # [B, C, H]
    logprobs: torch.Tensor      # [B, C+1] fp32: logprobs[b, t] is the reported log-prob of tokens[b, t]
    cache: KVCache
    draft_state: DraftState | None
    alloc_rows: int = 0         # rows of the tokens / features allocations (see keep_rows)
    max_slots: int = 0          # the most cache slots a row can need (prompt + budget + tree)

    def kv_bytes(self) -> int:
        """KV bytes held: the target's cache and the drafter's (what ``rollout.kv_cache_gib`` bounds)."""
        return self.cache.nbytes() + draft_kv_bytes(self.draft_state)

    def reserve(self, slots: int, used: int) -> None:
        """Grow every slot-indexed buffer to hold `slots` slots per row (see KVCache.reserve);
        `used` is the longest committed length (known on the host)."""
        slots = min(slots, self.max_slots)
        if slots <= self.features.shape[1]:
            return
        self.cache.reserve(slots, self.max_slots)
        if self.draft_state is not None:
            self.draft_state.reserve(slots, self.max_slots)
        cap = self.cache.capacity
        self.tokens = grow_slots(self.tokens, 1, used + 1, cap + 1)
        self.logprobs = grow_slots(self.logprobs, 1, used + 1, cap + 1)
        self.features = grow_slots(self.features, 1, used, cap)
        self.alloc_rows = self.rows.numel()

    def select(self, keep: list[int], used: int) -> None:
        """Keep rows `keep` (host list, in that order); `used` is the longest committed length."""
        alloc = self.alloc_rows  # tokens[b, :L+1] and features[b, :L] are live
        self.tokens, _ = keep_rows(self.tokens, keep, used + 1, 0, 1, alloc)
        self.logprobs, _ = keep_rows(self.logprobs, keep, used + 1, 0, 1, alloc)
        self.features, self.alloc_rows = keep_rows(self.features, keep, used, 0, 1, alloc)
        index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        for name in ("rows", "seq_ids", "prompt_len", "lengths", "num_gen"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.cache.select_rows(keep, used)
        if self.draft_state is not None:
            self.draft_state.select_rows(keep)


def draft_kv_bytes(state: DraftState | None) -> int:
    """Bytes of a drafter state's own KV cache (EAGLE's ``EagleState.cache``; 0 for a state without one)."""
    cache = getattr(state, "cache", None)
    return cache.nbytes() if cache is not None else 0
