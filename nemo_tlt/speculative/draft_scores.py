"""How a drafter ranks candidate tokens, as a pure function of the sampling mode.

A draft tree is grown by cumulative scores (see nemo_tlt.speculative.tree), so the
score of a candidate should say how likely the target is to produce it:

* ``greedy`` and ``rejection``: the draft log-probabilities (log-softmax of the
  drafter's logits), as EAGLE-2 does.
* ``coupled``: the target will produce argmax(processed log-probs + g), where the
  Gumbel noise g is keyed by (seed, sequence, position, token) and known before the
  target runs (nemo_tlt.speculative.sampling). The drafter ranks with the *same*
  noise: a candidate's score is its perturbed draft log-prob minus the best
  perturbed draft log-prob at that position (0 for the drafter's own Gumbel-max
  sample, negative for the runners-up). If the drafter's distribution were the
  target's, its top candidate would always be accepted; a plain top-k of the draft
  distribution instead matches a temperature-1 sample only as often as the target
  happens to sample its mode.

Scores never change what is emitted: verification re-draws every token from the
target with its own noise. They only change which candidates are verified.
"""
from __future__ import annotations

import torch

from nemo_tlt.speculative.sampling import SamplingParams, process_logits


def draft_scores(logits: torch.Tensor, depth: int, sampling: SamplingParams | None,
                 noise: torch.Tensor | None) -> torch.Tensor:
    """Scores [B, V] or [B, k, V] of the candidates at tree depth `depth` (1 = the
    root's children) from draft logits of the same shape. `noise` [B, D, V] is the
    coupled noise of depths 1..D (`coupled_noise_table` from the root's position + 1);
    it is needed, and only used, in ``coupled`` mode. Rows' scores are <= 0: log-probs,
    or in ``coupled`` mode with the drafter's Gumbel-max sample at 0."""
    if sampling is None or sampling.mode != "coupled":
        return torch.log_softmax(logits.float(), -1)
    if noise is None or noise.shape[1] < depth:
        raise ValueError(f"draft_scores: coupled sampling needs the noise of depth {depth}, got "
                         f"{None if noise is None else tuple(noise.shape)}")
    g = noise[:, depth - 1]
    perturbed = process_logits(logits, sampling) + (g[:, None, :] if logits.dim() == 3 else g)
    return perturbed - perturbed.amax(-1, keepdim=True)
