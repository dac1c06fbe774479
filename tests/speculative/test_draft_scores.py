"""Draft scores: log-probs for greedy / rejection; in coupled mode, ranked with the
noise the target samples with, so a drafter equal to the target is always right."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.speculative.draft_scores import draft_scores
from nemo_tlt.speculative.sampling import SamplingParams, coupled_gumbel, coupled_noise_table, draw


def test_noise_table_is_the_keyed_noise_of_consecutive_positions():
    seq, first = torch.tensor([4, 0, 11]), torch.tensor([7, 30, 2])
    table = coupled_noise_table(9, seq, first, 3, 20)
    assert table.shape == (3, 3, 20)
    for j in range(3):
        torch.testing.assert_close(table[:, j], coupled_gumbel(9, seq, first + j, 20), atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_non_coupled_modes_rank_by_draft_log_probs(mode):
    logits = torch.randn(5, 3, 17, generator=torch.Generator().manual_seed(0))
    scores = draft_scores(logits, 2, SamplingParams(mode=mode, temperature=0.5), None)
    torch.testing.assert_close(scores, torch.log_softmax(logits, -1))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 5)])
def test_coupled_top_candidate_is_the_targets_draw(temperature, top_k):
    """When the draft logits are the target's, the best-scored candidate at every depth
    is exactly the token the target's coupled draw produces there."""
    g = torch.Generator().manual_seed(1)
    B, D, V = 64, 4, 31
    sp = SamplingParams(mode="coupled", temperature=temperature, top_k=top_k, seed=123)
    seq, L = torch.randint(0, 1000, (B,), generator=g), torch.randint(5, 300, (B,), generator=g)
    noise = coupled_noise_table(sp.seed, seq, L + 1, D, V)
    for depth in range(1, D + 1):
        logits = 3 * torch.randn(B, V, generator=g)
        scores = draft_scores(logits, depth, sp, noise)
        assert torch.equal(scores.argmax(-1), draw(logits, sp, seq, L + depth, None))
        assert (scores <= 0).all() and torch.equal(scores.amax(-1), torch.zeros(B))
        # [B, k, V] logits (a tree frontier) share their depth's noise
        wide = draft_scores(logits[:, None].expand(B, 3, V), depth, sp, noise)
        torch.testing.assert_close(wide, scores[:, None].expand(B, 3, V))


def test_coupled_ranking_beats_the_draft_mode_at_temperature_one():
    """Draft top-1 matches a temperature-1 target draw only as often as the target
    samples its mode; the coupled ranking matches it always (same distribution)."""
    g = torch.Generator().manual_seed(2)
    B, V = 2000, 31
    sp = SamplingParams(mode="coupled", temperature=1.0, seed=5)
    seq, L = torch.arange(B), torch.zeros(B, dtype=torch.long)
    logits = torch.randn(B, V, generator=g)
    target = draw(logits, sp, seq, L + 1, None)
    mode_hits = (logits.argmax(-1) == target).float().mean()
    coupled = draft_scores(logits, 1, sp, coupled_noise_table(sp.seed, seq, L + 1, 1, V)).argmax(-1)
    assert mode_hits < 0.5 and bool((coupled == target).all())


def test_coupled_scores_need_the_noise():
    with pytest.raises(ValueError, match="noise of depth 3"):
        draft_scores(torch.zeros(2, 5), 3, SamplingParams(mode="coupled"), torch.zeros(2, 2, 5))
    with pytest.raises(ValueError, match="noise"):
        draft_scores(torch.zeros(2, 5), 1, SamplingParams(mode="coupled"), None)
