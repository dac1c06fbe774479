"""EAGLE-3 drafter: fuses the target's low, middle and high layer outputs.

Shapes follow EAGLE-3 (SafeAILab ``cnets.py``) and the checkpoints vLLM, SGLang and
TensorRT-LLM load (``LlamaForCausalLMEagle3``):

    g[t]   = concat of the target's captured layer outputs at position t     [k*H]
    h[t]   = fc(g[t])                      (no bias)                        [H]
    o[t+1] = midlayer(embed(x[t+1]), h[t])                                   [H]
    p(x[t+2]) = softmax(lm_head(norm(o[t+1])))   over the draft vocabulary

``midlayer`` is one Llama decoder layer whose attention reads
``[input_layernorm(embed) ; hidden_norm(h)]`` (2H wide: q/k/v projections take 2H)
with ``h`` as the residual; its MLP is the usual H -> I -> H. The output ``o`` (before
the final norm) is what deeper draft steps are fed in place of ``h`` (training-time
test, nemo_tlt.drafter.ttt). The embedding is the target's, read through the
``target`` argument (frozen, never copied); the LM head is the drafter's own, over
a draft vocabulary of ``draft_vocab_size`` target ids with the ``d2t``/``t2d`` maps
of nemo_tlt.drafter.draft_vocab (full vocabulary: d2t = 0, t2d all True).

Captured layers are indexed like TensorRT-LLM's ``eagle3_layers_to_capture``: the
output of 0-based decoder layer i. vLLM and SGLang number the same tensor i + 1
(the input of layer i + 1); the HF export converts.

Features per position (what the engine hands over and the harvest stores; layout in
nemo_tlt.drafter.features), ``feature_width = (k + 1) * H``: the k captured layer
outputs, then the target's final hidden state (after its final norm). The drafter's
input is the first k*H; the final state is for training only: its logits under the
target's head are the soft labels of EAGLE-3's loss (nemo_tlt.drafter.ttt).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.drafter.base import DraftContext, check_same_dims
from nemo_tlt.drafter.draft_vocab import draft_ids, vocab_maps
from nemo_tlt.drafter.eagle import EagleState
from nemo_tlt.drafter.eagle_tree import propose_tree
from nemo_tlt.drafter.features import feature_width
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.layers import MLP, Attention, RMSNorm
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree
from nemo_tlt.speculative.tree_shape import TreeShape

log = logging.getLogger(__name__)


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """TensorRT-LLM's default ``(1, L//2 - 1, L - 4)`` where it accepts the model
    (L > 5); for shallower targets, which it refuses, the first, middle and last
    layer ``(0, (L-1)//2, L-1)``."""
    check_int("num_layers", num_layers, 1)
    if num_layers > 5:
        return (1, num_layers // 2 - 1, num_layers - 4)
    return (0, (num_layers - 1) // 2, num_layers - 1)


@dataclass(frozen=True)
class Eagle3Config:
    """`layer` shapes the draft decoder layer like one of the target's (Llama-style:
    no attention biases) and carries the target's vocabulary size; `capture_layers`
    are the target layers fused (see module docstring); `ttt_steps` draft steps are
    unrolled in training, step j weighted ``ttt_decay ** j``."""
    layer: LMConfig
    capture_layers: tuple[int, ...]
    draft_vocab_size: int
    ttt_steps: int = 3
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.layer.num_layers != 1:
            raise ValueError(f"Eagle3Config.layer.num_layers must be 1, got {self.layer.num_layers}")
        if self.layer.qkv_bias or self.layer.o_proj_bias:
            raise ValueError("Eagle3Config.layer must have no attention biases (qkv_bias=False, a Llama layer)")
        object.__setattr__(self, "capture_layers", tuple(self.capture_layers))
        if not self.capture_layers:
            raise ValueError("Eagle3Config.capture_layers must list at least one target layer")
        for i in self.capture_layers:
            check_int("Eagle3Config.capture_layers[]", i, 0)
        check_int("Eagle3Config.draft_vocab_size", self.draft_vocab_size, 1, self.layer.vocab_size)
        check_int("Eagle3Config.ttt_steps", self.ttt_steps, 1)
        check_float("Eagle3Config.ttt_decay", self.ttt_decay, 0, 1, lo_open=True)

    @classmethod
    def from_target(cls, target: LMConfig, capture_layers: tuple[int, ...] | None = None,
                    draft_vocab_size: int | None = None, ttt_steps: int = 3,
                    ttt_decay: float = 0.8) -> "Eagle3Config":
        layer = replace(target, family="llama", num_layers=1, qkv_bias=False, tie_word_embeddings=False)
        layers = default_capture_layers(target.num_layers) if capture_layers is None else tuple(capture_layers)
        return cls(layer, layers, target.vocab_size if draft_vocab_size is None else draft_vocab_size,
                   ttt_steps, ttt_decay)

    def to_dict(self) -> dict:
        return {"layer": self.layer.to_dict(), "capture_layers": list(self.capture_layers),
                "draft_vocab_size": self.draft_vocab_size, "ttt_steps": self.ttt_steps, "ttt_decay": self.ttt_decay}

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        return cls(LMConfig(**d["layer"]), tuple(d["capture_layers"]), d["draft_vocab_size"], d["ttt_steps"],
                   d["ttt_decay"])


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: input x = [embed ; h] (2H), output [H] (see module docstring)."""

    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        H = c.hidden_size
        self.hidden_size = H
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = Attention(replace(c, hidden_size=2 * H, head_dim=c.head_dim))
        self.self_attn.o_proj = nn.Linear(c.num_heads * c.head_dim, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = MLP(c)

    def attn_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's 2H input, the residual h) of x = [embed ; h]."""
        emb, h = x.split(self.hidden_size, -1)
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), -1), h

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer: int, mask: torch.Tensor | None, write_idx: torch.Tensor | None) -> torch.Tensor:
        a, h = self.attn_input(x)
        return self.finish(h, self.self_attn(a, cos, sin, cache, layer, mask, write_idx))


class Eagle3Drafter(nn.Module):
    kind = "eagle3"

    def __init__(self, config: Eagle3Config, generator: torch.Generator | None = None) -> None:
        """`generator` seeds the initial weights (N(0, 0.02)); norms start at one, the
        draft vocabulary at its first `draft_vocab_size` ids (see `set_draft_vocab`)."""
        super().__init__()
        c = config.layer
        self.config = config
        self._warned_depths: set[int] = set()
        self.fc = nn.Linear(len(config.capture_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        d2t, t2d = vocab_maps(torch.arange(config.draft_vocab_size), c.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02, generator=generator)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the engine must hand over as features."""
        return self.config.capture_layers

    @property
    def feature_width(self) -> int:
        """Width of one position's features: k captured layers, then the final state."""
        return feature_width(self.config.layer.hidden_size, self.config.capture_layers)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """h = fc(captured layers) from features [..., k*H] or [..., feature_width]
        (nemo_tlt.drafter.features)."""
        return self.fc(features[..., : self.fc.in_features].to(self.fc.weight.dtype))

    @property
    def full_vocab(self) -> bool:
        return self.config.draft_vocab_size == self.config.layer.vocab_size

    @torch.no_grad()
    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Use the sorted target ids `ids` (draft_vocab_size of them) as the draft vocabulary."""
        if len(ids) != self.config.draft_vocab_size:
            raise ValueError(f"set_draft_vocab: {len(ids)} ids given, draft_vocab_size is "
                             f"{self.config.draft_vocab_size}")
        d2t, t2d = vocab_maps(ids, self.config.layer.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_head_from(self, target: DecoderLM) -> None:
        """Start the LM head from the target's rows of the draft vocabulary. A tensor-parallel
        target holds only its own vocab rows: refused (start from the whole model, or a TargetView)."""
        if target.tp is not None:
            raise ValueError(f"EAGLE-3 init_head_from: the target is tensor parallel (size {target.tp.size}) and "
                             "holds only its own LM-head rows; initialise from the whole model or a TargetView")
        self.lm_head.weight.copy_(target.lm_head_weight[draft_ids(self.d2t)])

    # ---- checks ------------------------------------------------------------
    def check_target(self, target: DecoderLM) -> None:
        c, t = self.config.layer, target.config
        check_same_dims("EAGLE-3", c.hidden_size, c.vocab_size, target)
        if (c.num_heads, c.num_kv_heads, c.head_dim) != (t.num_heads, t.num_kv_heads, t.head_dim):
            raise ValueError(f"EAGLE-3 drafter attention (heads={c.num_heads}, kv_heads={c.num_kv_heads}, "
                             f"head_dim={c.head_dim}) does not match the target's (heads={t.num_heads}, "
                             f"kv_heads={t.num_kv_heads}, head_dim={t.head_dim})")
        bad = [i for i in self.capture_layers if i >= t.num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 drafter capture_layers={self.capture_layers} name layers {bad} the "
                             f"target does not have (num_layers={t.num_layers})")

    def check_shape(self, shape: TreeShape) -> None:
        """A tree wider than the draft vocabulary is refused; one deeper than the training-
        time test unrolled (``ttt_steps``) drafts from inputs the drafter never trained on
        (its acceptance falls past that depth): warned once per depth."""
        if shape.topk > self.config.draft_vocab_size:
            raise ValueError(f"TreeShape.topk={shape.topk} exceeds the draft vocabulary size "
                             f"{self.config.draft_vocab_size}")
        if shape.depth > self.config.ttt_steps and shape.depth not in self._warned_depths:
            self._warned_depths.add(shape.depth)
            log.warning("EAGLE-3 drafter: tree %s drafts %d tokens deep, but training-time test unrolled only "
                        "ttt_steps=%d; tokens past that depth are rarely accepted (train with ttt_steps >= the "
                        "deepest tree)", shape.name, shape.depth, self.config.ttt_steps)

    def forwards_per_draft(self, shape: TreeShape) -> int:
        return shape.depth  # one catch-up, then depth-1 expansions

    # ---- forward -------------------------------------------------------------
    def forward(self,
                target: DecoderLM,
                next_tokens: torch.Tensor,                 # [B, T] long, tokens x[t+1]
                h: torch.Tensor,                           # [B, T, H] fused features self.fc(g), or outputs
                positions: torch.Tensor | None = None,     # [B, T] long
                cache: KVCache | None = None,              # the drafter's own, one layer
                new_mask: torch.Tensor | None = None,      # [B, T, T] bool
                cache_mask: torch.Tensor | None = None,    # [B, T, S] bool
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor:                         # [B, T, H] outputs o, before the final norm
        """The midlayer over [embed(x[t+1]), h[t]]."""
        emb = target.model.embed_tokens(next_tokens).detach()  # shared and frozen: no gradient to the target
        x = torch.cat((emb.to(h.dtype), h), -1)
        return target.run_layers(x, [self.midlayer], positions, cache, new_mask, cache_mask, rope)

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.lm_head(self.norm(out))

    def init_state(self, batch: int, capacity: int) -> EagleState:
        c = self.config.layer
        w = self.fc.weight
        return EagleState(KVCache(1, batch, c.num_kv_heads, capacity, c.head_dim, w.dtype, w.device))

    # ---- drafting (see nemo_tlt.drafter.eagle_tree) --------------------------
    def feed_committed(self, target: DecoderLM, tokens: torch.Tensor, features: torch.Tensor,
                       positions: torch.Tensor, cache: KVCache, new_mask: torch.Tensor) -> torch.Tensor:
        return self(target, tokens, self.fuse(features), positions, cache, new_mask)

    def feed_nodes(self, target: DecoderLM, tokens: torch.Tensor, parent_out: torch.Tensor, cache: KVCache,
                   cache_mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self(target, tokens, parent_out, None, cache, None, cache_mask, rope)

    def draft_logits(self, target: DecoderLM, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: ids outside the draft vocabulary get -inf."""
        logits = self.head(out)
        if self.full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.layer.vocab_size), float("-inf"))
        full[..., draft_ids(self.d2t)] = logits
        return full

    def propose(self, state: EagleState, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        return propose_tree(self, state.cache, ctx, shape)
