"""The drafter protocol the rollout engine talks to, and the context it drafts from.

A drafter shares the target's embedding and LM head (read through the target,
never copied or trained) and proposes a `DraftTree` for every running row. Its
private state (a KV cache for EAGLE, nothing for Medusa) lives in a `DraftState`
that the engine keeps in step with its own rows.

Sequence bookkeeping shared by all drafters (per row b, L = committed length):
``tokens[b, t]`` is token x_t for t <= L (x_L is the root: produced by the target,
not yet in its KV cache); ``features[b, t]`` for t < L is the target's final
hidden state at position t, the one that predicted x_{t+1}.

A drafter turns its logits into candidate scores with `DraftContext.score`, which
knows the sampling mode (see nemo_tlt.speculative.draft_scores): in ``coupled``
mode the candidates are ranked with the very noise the target will sample with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.draft_scores import draft_scores
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree import DraftTree
from nemo_tlt.speculative.tree_shape import TreeShape


@dataclass
class DraftContext:
    target: DecoderLM
    tokens: torch.Tensor     # [B, C] long
    features: torch.Tensor   # [B, C, H]
    lengths: torch.Tensor    # [B] long, committed target length L
    sampling: SamplingParams | None = None  # None: rank by draft log-probs
    noise: torch.Tensor | None = None       # [B, D, V] coupled noise of tree depths 1..D

    def score(self, logits: torch.Tensor, depth: int) -> torch.Tensor:
        """Candidate scores from draft logits [B, V] or [B, k, V] at tree depth `depth`."""
        return draft_scores(logits, depth, self.sampling, self.noise)


class DraftState(Protocol):
    def select_rows(self, rows: torch.Tensor) -> None: ...

    def reserve(self, slots: int, limit: int) -> None:
        """Make room for `slots` positions per row (the engine's cache grows alike)."""
        ...


class Drafter(Protocol):
    kind: str

    def init_state(self, batch: int, capacity: int) -> DraftState: ...

    def propose(self, state: DraftState, ctx: DraftContext, shape: TreeShape) -> DraftTree: ...

    def check_shape(self, shape: TreeShape) -> None: ...

    def check_target(self, target: DecoderLM) -> None: ...

    def forwards_per_draft(self, shape: TreeShape) -> int: ...


def check_same_dims(kind: str, hidden_size: int, vocab_size: int, target: DecoderLM) -> None:
    """A drafter built for another target is refused, naming both sizes."""
    c = target.config
    if hidden_size != c.hidden_size:
        raise ValueError(f"{kind} drafter hidden_size={hidden_size} does not match the target's "
                         f"hidden_size={c.hidden_size}")
    if vocab_size != c.vocab_size:
        raise ValueError(f"{kind} drafter vocab_size={vocab_size} does not match the target's "
                         f"vocab_size={c.vocab_size}")


class NoDraftState:
    def select_rows(self, rows: torch.Tensor) -> None:
        return None

    def reserve(self, slots: int, limit: int) -> None:
        return None
