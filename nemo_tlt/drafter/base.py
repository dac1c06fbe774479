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

Devices and dtypes: a drafter lives on the target's device and makes every tensor
there. Its dtype is its own: the idle-time trainer keeps fp32 master weights, and the
engine serves that very module, whatever the target's dtype (a one-layer drafter in
fp32 costs little beside a bf16 target), or a bf16 copy of it (``drafter.serve_dtype``).
What it reads from the target (embeddings, features) is cast to the drafter's dtype
where it enters, and what it hands the target's LM head is cast to the head's dtype
where it leaves; draft scores are fp32.
The drafter's dtype changes which candidates are proposed, never which tokens are
emitted (verification is the target's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only `rows`, in that order (the engine passes a host list)."""
        ...

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


@runtime_checkable
class CapturesLayers(Protocol):
    """A drafter that reads target layers besides the final state (EAGLE-3): the engine and
    the policy's forward hand it, per position, the outputs of ``capture_layers`` (0-based
    target layers, in this order) then the final state, [.., (len(capture_layers) + 1) * H]."""

    capture_layers: tuple[int, ...]


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
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        return None

    def reserve(self, slots: int, limit: int) -> None:
        return None
