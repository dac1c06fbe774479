"""`VocabParallelEmbedding`: a token embedding whose rows are split over TP ranks.

Rank r holds rows ``vocab_rows(vocab, size, r)`` (nemo_tlt.model.tp_layout) as
``weight``, so its ``state_dict`` key is the canonical ``model.embed_tokens.weight``
with the local shape. A lookup reads the ids this rank holds, writes zeros for the
others and sums over the ranks (one all-reduce of [..., H]): exactly one rank adds a
nonzero row, so the result equals the plain embedding's, bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.model.tp_layout import vocab_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.lo, self.hi = vocab_rows(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.hi - self.lo)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce_(out.masked_fill_(outside[..., None], 0))
