"""Sequence packing: the plan, the layout, and equality with the padded reference
(loss, gradients, per-token predictions) on a long-tailed mix of lengths."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from nemo_tlt.drafter.data import DrafterSample, eagle_pairs, pad_eagle_batch
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.packing import pack_eagle_batch, packed_attention_mask, packing_efficiency, plan_packing
from nemo_tlt.drafter.train import drafter_loss
from tiny import tiny_target

BUDGET = 128


def _samples(lengths: list[int], hidden: int, seed: int = 0, vocab: int = 32) -> list[DrafterSample]:
    g = torch.Generator().manual_seed(seed)
    return [DrafterSample(torch.randint(0, vocab, (m,), generator=g), torch.randn(m - 1, hidden, generator=g))
            for m in lengths]


def _long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    """Token counts with a heavy (Pareto) tail: most short, a few near the budget."""
    rng = np.random.default_rng(seed)
    pairs = np.clip(np.round(4 * (1 + rng.pareto(1.2, n))), 1, BUDGET).astype(int)
    pairs[0] = BUDGET  # at least one sample fills a row alone
    return [int(p) + 2 for p in pairs]  # m tokens give m - 2 pairs


def _slots(samples: list[DrafterSample], budget: int) -> list[tuple[int, int, int]]:
    """(row, start, n) of every sample in the packed layout, from the plan."""
    lengths = [s.num_pairs for s in samples]
    where: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(samples)
    for row, members in enumerate(plan_packing(lengths, budget)):
        start = 0
        for j in members:
            where[j] = (row, start, lengths[j])
            start += lengths[j]
    return where


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=0)
    torch.manual_seed(1)
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    return target, drafter


# ---------------------------------------------------------------- plan_packing

def test_plan_is_first_fit_decreasing():
    assert plan_packing([5, 4, 3, 3, 2, 1], 6) == [[0, 5], [1, 4], [2, 3]]
    assert plan_packing([3, 3, 3], 3) == [[0], [1], [2]]
    assert plan_packing([], 4) == []


def test_plan_covers_every_item_once_within_budget_and_near_optimal():
    rng = np.random.default_rng(3)
    for trial in range(20):
        budget = int(rng.integers(8, 200))
        lengths = [int(x) for x in rng.integers(1, budget + 1, size=int(rng.integers(1, 60)))]
        bins = plan_packing(lengths, budget)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(len(lengths))), trial
        assert all(sum(lengths[i] for i in b) <= budget for b in bins), trial
        # First fit never leaves two bins that could have been merged.
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert all(loads[i] + loads[j] > budget for i in range(len(bins)) for j in range(i + 1, len(bins))), trial


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match=r"lengths\[1\]=9 exceeds the budget 8"):
        plan_packing([3, 9], 8)
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        plan_packing([0], 8)
    with pytest.raises(ValueError, match="budget"):
        plan_packing([1], 0)


# ------------------------------------------------------------------ the layout

def test_layout_positions_masks_and_contents():
    lengths = [7, 4, 12, 3, 6]  # tokens -> pairs 5, 2, 10, 1, 4
    samples = _samples(lengths, hidden=8)
    batch = pack_eagle_batch(samples, token_budget=12)
    where = _slots(samples, 12)
    B, T = batch.mask.shape
    assert B == len({r for r, _, _ in where}) and T == max(sum(n for r2, _, n in where if r2 == r) for r in range(B))
    expected_valid = torch.zeros(B, T, dtype=torch.bool)
    for s, (row, start, n) in zip(samples, where):
        tok, fin, ftg = eagle_pairs(s)
        span = slice(start, start + n)
        assert torch.equal(batch.next_tokens[row, span], tok)
        assert torch.equal(batch.in_feat[row, span], fin)
        assert torch.equal(batch.target_feat[row, span], ftg)
        assert torch.equal(batch.positions[row, span], torch.arange(n))  # restart at 0
        expected_valid[row, span] = True
        block = batch.new_mask[row, span, span]
        assert torch.equal(block, torch.ones(n, n, dtype=torch.bool).tril())
        # nothing outside its own block, in either direction
        outside = torch.ones(T, dtype=torch.bool)
        outside[span] = False
        assert not batch.new_mask[row, span][:, outside].any()
        assert not batch.new_mask[row][outside][:, span].any()
    assert torch.equal(batch.mask, expected_valid)
    assert batch.num_tokens == sum(m - 2 for m in lengths)
    pad = ~batch.mask
    # padding sees only itself, so no attention row is empty
    assert batch.new_mask.any(-1).all()
    for row in range(B):
        for i in pad[row].nonzero().flatten().tolist():
            assert batch.new_mask[row, i].nonzero().flatten().tolist() == [i]


def test_attention_mask_of_segments():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = packed_attention_mask(seg)[0].int()
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]])
    assert torch.equal(m, expected)


def test_budget_options_and_refusals():
    samples = _samples([20, 2, 9], hidden=4)  # the 2-token sample has no pair: dropped
    auto = pack_eagle_batch(samples)  # budget = longest sample (18 pairs)
    assert auto.num_tokens == 18 + 7 and auto.mask.shape == (2, 18)
    fixed = pack_eagle_batch(samples, token_budget=32, pad_to_budget=True)
    assert fixed.mask.shape == (1, 32) and fixed.num_tokens == 25
    assert packing_efficiency(fixed) == pytest.approx(25 / 32)
    with pytest.raises(ValueError, match=r"sample 0 has 18 training pairs .*token_budget=10"):
        pack_eagle_batch(samples, token_budget=10)
    with pytest.raises(ValueError, match="no sample"):
        pack_eagle_batch(_samples([2, 1 + 1], hidden=4))
    with pytest.raises(ValueError, match="sample 1 has hidden size 5"):
        pack_eagle_batch(_samples([5], hidden=4) + _samples([5], hidden=5))


# ------------------------------------------------- equality with the padded path

def test_packed_loss_gradients_and_predictions_equal_padded(setup):
    target, drafter = setup
    lengths = _long_tail_lengths(40)
    samples = _samples(lengths, target.config.hidden_size, seed=5, vocab=target.config.vocab_size)
    padded = pad_eagle_batch(samples)
    packed = pack_eagle_batch(samples, token_budget=BUDGET)
    assert packed.num_tokens == padded.num_tokens
    assert packing_efficiency(packed) > 2 * packing_efficiency(padded)  # the point of packing

    def loss_and_grads(batch):
        drafter.zero_grad(set_to_none=True)
        loss, stats = drafter_loss(drafter, target, batch, reg_weight=1.0, ce_weight=0.1)
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in drafter.named_parameters()}

    loss_pad, stats_pad, g_pad = loss_and_grads(padded)
    loss_pack, stats_pack, g_pack = loss_and_grads(packed)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-6, atol=1e-7)
    for key in ("reg", "ce", "top1"):
        assert stats_pack[key] == pytest.approx(stats_pad[key], rel=1e-5, abs=1e-7)
    for name in g_pad:
        assert torch.isfinite(g_pack[name]).all(), name
        torch.testing.assert_close(g_pack[name], g_pad[name], rtol=1e-4, atol=1e-7, msg=name)

    # Per-token predictions, not just their mean.
    with torch.no_grad():
        p_pad = drafter(target, padded.next_tokens, padded.in_feat, padded.positions, None, padded.new_mask)
        p_pack = drafter(target, packed.next_tokens, packed.in_feat, packed.positions, None, packed.new_mask)
    for i, (row, start, n) in enumerate(_slots(samples, BUDGET)):
        torch.testing.assert_close(p_pack[row, start:start + n], p_pad[i, :n], rtol=1e-5, atol=1e-5)


def test_a_wrong_mask_is_caught(setup):
    """The equality test has teeth: plain causal attention over a packed row differs."""
    target, drafter = setup
    samples = _samples([30, 25, 20, 12], target.config.hidden_size, seed=2, vocab=target.config.vocab_size)
    packed = pack_eagle_batch(samples, token_budget=100)
    padded = pad_eagle_batch(samples)
    with torch.no_grad():
        good, _ = drafter_loss(drafter, target, packed)
        leaky, _ = drafter_loss(drafter, target, type(packed)(packed.next_tokens, packed.in_feat,
                                                              packed.target_feat, packed.positions, packed.mask))
        ref, _ = drafter_loss(drafter, target, padded)
    torch.testing.assert_close(good, ref, rtol=1e-6, atol=1e-7)
    assert abs(float(leaky) - float(ref)) > 1e-4


def test_perturbing_one_sample_leaves_the_others_unchanged(setup):
    target, drafter = setup
    H, V = target.config.hidden_size, target.config.vocab_size
    lengths = _long_tail_lengths(24, seed=7)
    samples = _samples(lengths, H, seed=9, vocab=V)
    victim = next(i for i, (row, start, n) in enumerate(_slots(samples, BUDGET))
                  if start == 0 and sum(1 for r, _, _ in _slots(samples, BUDGET) if r == row) > 1)
    g = torch.Generator().manual_seed(11)
    changed = list(samples)
    s = samples[victim]
    changed[victim] = DrafterSample((s.tokens + 1) % V, s.hidden + torch.randn(s.hidden.shape, generator=g))

    def predict(batch):
        with torch.no_grad():
            return drafter(target, batch.next_tokens, batch.in_feat, batch.positions, None, batch.new_mask)

    before = predict(pack_eagle_batch(samples, BUDGET))
    after = predict(pack_eagle_batch(changed, BUDGET))
    where = _slots(samples, BUDGET)
    assert where == _slots(changed, BUDGET)  # same lengths, same plan
    for i, (row, start, n) in enumerate(where):
        a, b = before[row, start:start + n], after[row, start:start + n]
        if i == victim:
            assert not torch.allclose(a, b)
        else:
            assert torch.equal(a, b), f"sample {i} changed when sample {victim} was perturbed"
