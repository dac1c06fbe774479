"""`DecoderLM`: the reference decoder-only LM (Llama / Qwen2 families) in plain PyTorch.

Its module tree mirrors HF's `LlamaForCausalLM` / `Qwen2ForCausalLM`, so
`state_dict()` uses the canonical (HF) names and loads HF weights as they are.
The model knows nothing about sampling or speculation: it maps tokens at given
positions, against an optional KV cache and a mask for the new block, to final
hidden states; `logits()` applies the LM head. `hidden_capture()` also returns the
outputs of chosen decoder layers from the same forward (an EAGLE-3 drafter fuses
them), at no extra pass. Checkpoint conversion lives elsewhere (nemo_tlt.weights).

Tensor parallelism (inference only): ``DecoderLM(config, tp)`` with ``tp.size > 1``
builds only this rank's parameters, in the rollout layout of nemo_tlt.model.tp_layout
(heads / kv heads / intermediate columns / vocab rows; norms whole), under the
canonical names with local shapes. ``config`` stays the full model's. Per forward
over the decoder each rank makes 1 all-reduce for the vocab-parallel embedding and 2
per layer (after ``o_proj`` and ``down_proj``), each of [B, T, H]; ``logits()`` makes
one all-gather and returns the full-vocabulary logits on every rank, identical
there. Memory per rank: 1/TP of every split weight (the vocab rows of embedding and
head: up to one row more), the norms whole, a KV cache of ``num_kv_heads / TP``
heads. ``lm_head_weight`` is this rank's vocab rows (use it for dtype and device; a
caller needing all rows refuses a TP model by name, e.g. EAGLE-3's ``init_head_from``).
An attention output bias (``o_proj_bias``) has no TP rule and is refused. With
``tp=None`` or size 1 the model is the plain single-process one, code path and numbers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.host import host_int
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.layers import DecoderLayer, RMSNorm, cache_attention_mask
from nemo_tlt.model.rope import rope_tables_for
from nemo_tlt.model.tensor_parallel import TensorParallel, active
from nemo_tlt.model.tp_layout import check_rollout_tp, vocab_rows
from nemo_tlt.model.vocab_parallel import VocabParallelEmbedding


class _Backbone(nn.Module):
    def __init__(self, config: LMConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if tp is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def check_tensor_parallel(config: LMConfig, tp: TensorParallel) -> None:
    """Refuse a config the rollout TP layout cannot split over ``tp.size`` ranks."""
    check_rollout_tp(config, tp.size)
    if config.o_proj_bias:
        raise ValueError(f"DecoderLM: tensor parallel size {tp.size} with an attention output bias (LMConfig "
                         "qkv_bias=True on family 'llama', HF attention_bias=true) is not built: o_proj.bias has "
                         "no TP rule (it would be added once per rank)")


class DecoderLM(nn.Module):
    def __init__(self, config: LMConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = active(tp)
        if tp is not None:
            check_tensor_parallel(config, tp)
        self.config = config
        self.tp = tp
        self.model = _Backbone(config, tp)
        lo, hi = (0, config.vocab_size) if tp is None else vocab_rows(config.vocab_size, tp.size, tp.rank)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, hi - lo, bias=False)
        cos, sin = rope_tables_for(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights_()

    @torch.no_grad()
    def init_weights_(self, generator: torch.Generator | None = None) -> "DecoderLM":
        """N(0, 0.02) for Linear / Embedding weights, zero biases, unit norms; pass a
        generator for an init that does not depend on the global RNG."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, VocabParallelEmbedding)):
                nn.init.normal_(module.weight, std=0.02, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight: [vocab_size, H], or with TP this rank's vocab rows."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `positions`; `bound` is a host-known upper bound of them (when it
        is inside the context, the check needs no read of the device)."""
        ctx = self.config.max_position_embeddings
        if bound is None or bound >= ctx:
            top = host_int(positions.max())
            if top >= ctx:
                raise ValueError(f"position {top} is beyond max_position_embeddings={ctx}")
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]

    def run_layers(self,
                   x: torch.Tensor,                       # [B, T, H] embeddings
                   layers: nn.ModuleList,
                   positions: torch.Tensor | None,        # [B, T] long
                   cache: KVCache | None,
                   new_mask: torch.Tensor | None,         # [B, T, T] bool, within the new block
                   cache_mask: torch.Tensor | None = None,  # [B, T, S] bool, over the cache's slots
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) of `positions`
                   taps: dict[int, torch.Tensor | None] | None = None,
                   ) -> torch.Tensor:                     # [B, T, H], before the final norm
        """Run `layers` over embeddings x. `taps` (layer index -> None) is
        filled with the output of each listed layer (residual stream after the layer). Without a cache the block is fully
        causal at positions 0..T-1 unless `positions`/`new_mask` say otherwise. With a
        cache the block is written at slots lengths[b] + t; `cache_mask` [B, T, S] (see
        `cache_attention_mask`) replaces the default visibility, and `rope` the
        (cos, sin) of `positions`: the drafter passes both while growing a tree."""
        B, T, _ = x.shape
        # Slots the block attends: the longest row's committed ones plus the block. A block's
        # positions never pass its last slot (a tree node sits at most its depth < T past L).
        slots = cache.known_max_length() + T if cache is not None else T
        if rope is None:
            bound = slots - 1 if cache is not None or positions is None else None
            if positions is None:
                start = cache.lengths[:, None] if cache is not None else 0
                positions = start + torch.arange(T, device=x.device)[None, :].expand(B, T)
            rope = self.rope(positions, bound)
        cos, sin = rope
        mask = write_idx = None
        if cache is not None:
            write_idx = cache.write_index(T)
            if cache_mask is None:
                if new_mask is None:
                    new_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T)
                cache_mask = cache_attention_mask(cache.lengths, write_idx, new_mask, slots)
            mask = cache_mask[:, None]
        elif new_mask is not None:
            mask = new_mask[:, None]
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, cache, i, mask, write_idx)
            if taps is not None and i in taps:
                taps[i] = x
        return x

    def hidden(self,
               input_ids: torch.Tensor,                   # [B, T] long
               positions: torch.Tensor | None = None,     # [B, T] long (None: after the cache's rows)
               cache: KVCache | None = None,
               new_mask: torch.Tensor | None = None,      # [B, T, T] bool (None: causal)
               ) -> torch.Tensor:                         # [B, T, H]
        """Last-layer hidden states after the final norm."""
        x = self.model.embed_tokens(input_ids)
        x = self.run_layers(x, self.model.layers, positions, cache, new_mask)
        return self.model.norm(x)

    def hidden_capture(self, input_ids: torch.Tensor, capture: tuple[int, ...],
                       positions: torch.Tensor | None = None, cache: KVCache | None = None,
                       new_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden(...)` [B, T, H] and, from the same forward, the outputs of decoder
        layers `capture` (0-based, before the final norm) concatenated in that order,
        [B, T, len(capture) * H]. A layer may be listed more than once."""
        bad = [i for i in capture if not 0 <= i < self.config.num_layers]
        if not capture or bad:
            raise ValueError(f"hidden_capture: capture={tuple(capture)} must list layer indices in "
                             f"[0, {self.config.num_layers}) (num_layers)")
        taps: dict[int, torch.Tensor | None] = dict.fromkeys(capture)
        x = self.run_layers(self.model.embed_tokens(input_ids), self.model.layers, positions, cache, new_mask,
                            taps=taps)
        return self.model.norm(x), torch.cat([taps[i] for i in capture], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., vocab_size] (with TP: gathered, the same on every rank)."""
        if self.tp is None:
            return F.linear(hidden, self.lm_head_weight)
        return self.tp.gather_vocab(F.linear(hidden, self.lm_head_weight), self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, new_mask: torch.Tensor | None = None
                ) -> torch.Tensor:  # [B, T, vocab_size]; arguments as `hidden`'s
        return self.logits(self.hidden(input_ids, positions, cache, new_mask))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A KV cache for this model (with TP: of this rank's kv heads)."""
        c = self.config
        p = self.model.embed_tokens.weight
        heads = c.num_kv_heads // (1 if self.tp is None else self.tp.size)
        return KVCache(c.num_layers, batch, heads, capacity, c.head_dim, p.dtype, p.device)

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def canonical_shapes(config: LMConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical (HF-named) tensor of the whole model of ``config`` and its shape
    (derived on the meta device: no memory)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DecoderLM(config).state_dict().items()}
