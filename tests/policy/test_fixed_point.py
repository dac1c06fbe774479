"""Fixed-point gradient sums: bit-identical whatever the order or split of the terms, within
the stated resolution of the exact sum, refusing what would overflow, NaN kept visible; and
the torch backend's pipelined update (``accumulate`` / ``apply_accumulated``) against its
plain ``update``."""
from __future__ import annotations

import itertools

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.policy.fixed_point import FRACTION_BITS, FixedPointGrads
from nemo_tlt.policy.torch_backend import TorchPolicy, build_decoder
from nemo_tlt.model.lm import DecoderLM


def _terms(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many decades: float sums of these depend on the order
    return [[torch.randn(5, 7, generator=g) * 10.0 ** torch.randint(-9, 1, (5, 7), generator=g),
             torch.randn(3, generator=g) * 1e-3] for _ in range(n)]


def _sum(terms, order, budget=1000) -> list[torch.Tensor]:
    acc = FixedPointGrads(terms[0], budget)
    for i in order:
        acc.add(terms[i], tokens=100)
    return acc.result(1.0)


def test_the_sum_does_not_depend_on_the_order():
    terms = _terms(6)
    ref = _sum(terms, range(6))
    for order in itertools.islice(itertools.permutations(range(6)), 1, 40):
        assert all(torch.equal(a, b) for a, b in zip(_sum(terms, order), ref))
    # a float32 sum of the same terms does depend on it (so the test above can fail)
    def f32(order):
        return sum((terms[i][0] for i in order), torch.zeros(5, 7))
    assert any(not torch.equal(f32(o), f32(range(6))) for o in itertools.permutations(range(6)))


def test_split_over_accumulators_equals_one_accumulator():
    """Two ranks' integer sums added (what the all-reduce does) equal one rank's."""
    terms = _terms(5, seed=1)
    a, b, whole = (FixedPointGrads(terms[0], 1000) for _ in range(3))
    for i, t in enumerate(terms):
        (a if i in (1, 4) else b).add(t, 100)
        whole.add(t, 100)
    a.flat += b.flat
    assert all(torch.equal(x, y) for x, y in zip(a.result(1.0), whole.result(1.0)))


def test_within_the_resolution_of_the_exact_sum():
    terms = _terms(6, seed=2)
    got = _sum(terms, range(6))
    exact = [sum(t[k].double() for t in terms) for k in range(2)]
    for g, e in zip(got, exact):
        # per term at most half a unit of 2**-FRACTION_BITS, then one rounding to float32
        assert torch.all((g.double() - e).abs() <= 6 * 0.5 * 2.0 ** -FRACTION_BITS + e.abs() * 2.0 ** -23)


def test_scale_and_shape():
    t = [torch.full((2, 3), 0.25)]
    acc = FixedPointGrads(t, token_budget=10)
    acc.add(t, tokens=5)
    acc.add(t, tokens=5)
    out = acc.result(2.0)
    assert out[0].shape == (2, 3) and out[0].dtype == torch.float32 and torch.all(out[0] == 1.0)


def test_a_term_beyond_its_token_share_of_the_range_is_refused_before_adding():
    budget = 1000
    acc = FixedPointGrads([torch.zeros(3)], budget)
    bound = 2.0 ** (62 - FRACTION_BITS) * 10 / budget
    acc.add([torch.tensor([bound * 0.99, 0.0, 0.0])], tokens=10)
    before = acc.flat.clone()
    with pytest.raises(FloatingPointError, match="pipelined_update.*exceeds the fixed-point range"):
        acc.add([torch.tensor([0.0, bound * 1.01, 0.0])], tokens=10)
    assert torch.equal(acc.flat, before)


def test_non_finite_terms_make_that_tensor_nan_only():
    acc = FixedPointGrads([torch.zeros(2), torch.zeros(2)], 10)
    acc.add([torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0])], 5)
    acc.add([torch.tensor([1.0, 1.0]), None], 5)
    first, second = acc.result(1.0)
    assert torch.isnan(first).all() and torch.equal(second, torch.tensor([1.0, 2.0]))


def _hard_float32_term(seed: int) -> list[torch.Tensor]:
    """float32 gradients that test the rounding: magnitudes over 30 decades, subnormals, signed
    zeros, exact halves of the resolution (ties round to even), values of 2**23 and more
    resolution units (already integers in float32) and values just inside the bound."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randn(64, 33, generator=g) * 10.0 ** torch.randint(-30, 1, (64, 33), generator=g).float()
    k = torch.arange(-40, 41, dtype=torch.float32)
    ties = (2 * k + 1) * 2.0 ** -(FRACTION_BITS + 1)  # (k + 1/2) units: round half to even
    big = torch.tensor([2.0 ** 23, 2.0 ** 23 + 2, 3.0 * 2 ** 30, 1.5, -7.25]) * 2.0 ** -FRACTION_BITS
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0 ** 15, -(2.0 ** 15)])
    return [spread, torch.cat([ties, big, special]), torch.randn(3, generator=g).float()]


def test_the_float32_fast_path_adds_the_reference_integers(monkeypatch):
    """Bit for bit the integers of the float64 reference path, for whole terms and for terms
    with missing tensors; and finite in-range float32 terms never take the reference path."""
    terms = [_hard_float32_term(s) for s in range(4)] + [[None, _hard_float32_term(9)[1], None]]
    fast, ref = (FixedPointGrads(terms[0], 1000) for _ in range(2))
    for t in terms:  # tokens=1000: the bound is 2**18, above every element
        present = [(k, g) for k, g in enumerate(t) if g is not None]
        ref._add_reference(present, 2.0 ** 18, 1000)
    with monkeypatch.context() as m:
        m.setattr(FixedPointGrads, "_add_reference", lambda *a: pytest.fail("took the reference path"))
        for t in terms:
            fast.add(t, tokens=1000)
    assert torch.equal(fast.flat, ref.flat)


# ---- the torch backend ------------------------------------------------------------------

def _policy(dtype=torch.float32) -> TorchPolicy:
    cfg = LMConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        canonical = DecoderLM(cfg).state_dict()
    model = build_decoder(canonical, cfg).to(dtype)
    return TorchPolicy(model, PolicyConfig(micro_batch=2), temperature=0.7)


def _groups(n: int, G: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(1, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        responses = [torch.randint(1, 40, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(G)]
        adv = torch.randn(G, generator=g)
        out.append(([(prompt, r) for r in responses], adv))
    return out


def _pipelined(policy: TorchPolicy, groups, order, budget: int = 4 * 4 * 16) -> dict:
    policy.begin_accumulation(budget)
    for i in order:
        batch, adv = groups[i]
        policy.accumulate(batch, adv, None, None)
    tokens = sum(len(r) for batch, _ in groups for _, r in batch)
    return policy.apply_accumulated(tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipelined_update_is_bitwise_independent_of_group_order(dtype):
    groups = _groups(4)
    a, b = _policy(dtype), _policy(dtype)
    out_a = _pipelined(a, groups, [0, 1, 2, 3])
    out_b = _pipelined(b, groups, [3, 1, 0, 2])
    assert out_a == out_b
    for (_, x), (_, y) in zip(a.canonical_weights(), b.canonical_weights()):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a.master.masters, b.master.masters))


def test_pipelined_update_equals_the_plain_update_within_float_rounding():
    groups = _groups(4)
    plain, piped = _policy(), _policy()
    batch = [seq for b, _ in groups for seq in b]
    adv = torch.cat([a for _, a in groups])
    tokens = sum(len(r) for _, r in batch)
    ref = plain.update(batch, adv, None, None, tokens)
    out = _pipelined(piped, groups, range(4))
    assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    before = dict(_policy().canonical_weights())
    moved = 0.0
    for (name, x), (_, y) in zip(plain.canonical_weights(), piped.canonical_weights()):
        assert torch.allclose(x, y, rtol=0, atol=1e-6), name
        moved = max(moved, float((x - before[name]).abs().max()))
    assert moved > 1e-5  # the step did move the weights (lr 5e-5, Adam)


def test_parts_add_up_to_the_whole_group_bitwise():
    """A group's micro-batches as separate pieces (as ranks claim them) give the whole group's sums."""
    groups = _groups(3)
    whole, pieces = _policy(), _policy()
    for p in (whole, pieces):
        p.begin_accumulation(256)
    for batch, adv in groups:
        whole.accumulate(batch, adv, None, None)
        for part in reversed(range(pieces.num_parts(batch))):
            pieces.accumulate(batch, adv, None, None, part=part)
    assert pieces.num_parts(groups[0][0]) == 2 and torch.equal(whole._sums.flat, pieces._sums.flat)
    with pytest.raises(ValueError, match="part 2 of a batch of 2"):
        pieces.accumulate(*groups[0], None, None, part=2)


def test_accumulate_needs_begin_accumulation():
    policy = _policy()
    batch, adv = _groups(1)[0]
    with pytest.raises(RuntimeError, match="begin_accumulation"):
        policy.accumulate(batch, adv, None, None)
    with pytest.raises(RuntimeError, match="begin_accumulation"):
        policy.apply_accumulated(10)
