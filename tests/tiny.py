"""Tiny models and an oracle drafter for tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_tlt.drafter.base import DraftContext, NoDraftState
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree, grow_tree
from nemo_tlt.speculative.tree_shape import TreeShape


def seeded_drafter(kind: str, cfg: LMConfig):
    """An untrained drafter of ``kind`` (eagle2 | eagle3) for ``cfg``, seeded."""
    from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
    from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter

    if kind == "eagle2":
        return EagleDrafter(EagleConfig.from_target(cfg), generator=torch.Generator().manual_seed(1))
    return Eagle3Drafter(Eagle3Config.from_target(cfg), generator=torch.Generator().manual_seed(1))


def ragged_requests(n: int = 12) -> list:
    """``n`` requests of 3-11 random prompt tokens in [3, 32), seeded, ``seq_id`` their index."""
    from nemo_tlt.rollout.protocol import Request

    g = torch.Generator().manual_seed(4)
    return [Request(tuple(torch.randint(3, 32, (int(torch.randint(3, 12, (1,), generator=g)),),
                                        generator=g).tolist()), seq_id=i) for i in range(n)]


def tiny_config(**kw) -> LMConfig:
    base = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                max_position_embeddings=512)
    base.update(kw)
    return LMConfig(**base)


def tiny_target(seed: int = 0, scale: float = 6.0, **kw) -> DecoderLM:
    """A random target with sharpened distributions (scaled weights), so that a
    drafter can agree with it often and greedy paths are long."""
    torch.manual_seed(seed)
    model = DecoderLM(tiny_config(**kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model.eval()


class OracleDrafter(torch.nn.Module):
    """Proposes from the target's true next-token distribution (computed without a
    cache from the full prefix), or from its reverse when `adversarial`. Tests only."""

    kind = "oracle"

    def __init__(self, adversarial: bool = False, temperature: float = 1.0) -> None:
        super().__init__()
        self.adversarial = adversarial
        self.temperature = temperature

    def check_target(self, target: DecoderLM) -> None:
        return None

    def check_shape(self, shape: TreeShape) -> None:
        return None

    def forwards_per_draft(self, shape: TreeShape) -> int:
        return shape.depth

    def init_state(self, batch: int, capacity: int) -> NoDraftState:
        return NoDraftState()

    def _next_logits(self, target: DecoderLM, tokens: torch.Tensor, L: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Target logits after x_0..x_L (per row) followed by `path` [N, d] (negated when
        adversarial, divided by the oracle's own temperature)."""
        N, d = path.shape
        width = int(L.max()) + 1 + d
        j = torch.arange(width)[None, :]
        rel = j - L[:, None] - 1                              # index into path
        base = tokens[:, :width] if tokens.shape[1] >= width else F.pad(tokens, (0, width - tokens.shape[1]))
        from_path = path.gather(1, rel.clamp(0, max(d - 1, 0))) if d else base
        seq = torch.where(rel < 0, base, torch.where(rel < d, from_path, torch.zeros_like(base)))
        logits = target(seq)[torch.arange(N), L + d].float() / self.temperature
        return -logits if self.adversarial else logits

    def propose(self, state, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        L, tokens = ctx.lengths, ctx.tokens
        B = L.shape[0]
        node_paths = torch.zeros(B, shape.max_nodes, shape.depth, dtype=torch.long)
        first = ctx.score(self._next_logits(ctx.target, tokens, L, tokens.new_zeros(B, 0)), 1)

        def expand(tok, nodes, parents, depth):
            k = tok.shape[1]
            prev = node_paths.gather(1, parents.clamp(min=0)[..., None].expand(B, k, shape.depth))[..., : depth - 1]
            path = torch.cat((prev, tok[..., None]), -1)                      # [B, k, depth]
            node_paths[torch.arange(B)[:, None], nodes, :depth] = path
            flat = self._next_logits(ctx.target, tokens.repeat_interleave(k, 0), L.repeat_interleave(k),
                                     path.flatten(0, 1))
            return ctx.score(flat.view(B, k, -1), depth + 1)

        return grow_tree(first, expand, shape)
