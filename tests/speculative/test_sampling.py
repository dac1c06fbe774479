"""Sampling: filters, coupled noise keyed by (seed, sequence, position), generator seeding."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.speculative.sampling import SamplingParams, coupled_gumbel, draw, process_logits


def test_top_k_top_p_filter():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = process_logits(logits, SamplingParams(mode="rejection", top_k=3)).exp()
    assert (p[0, 3:] == 0).all() and p[0, :3].sum().item() == pytest.approx(1.0)
    p = process_logits(logits, SamplingParams(mode="rejection", top_p=0.7)).exp()
    assert (p[0] > 0).tolist() == [True, True, False, False, False]


def test_coupled_noise_is_keyed_not_batched():
    seq, pos = torch.tensor([3, 9, 3]), torch.tensor([5, 5, 6])
    a = coupled_gumbel(7, seq, pos, 50)
    b = coupled_gumbel(7, seq.flip(0), pos.flip(0), 50).flip(0)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a[0], a[2]) and not torch.equal(a[0], coupled_gumbel(8, seq, pos, 50)[0])


def test_coupled_draw_samples_the_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0]).expand(20000, 4)
    params = SamplingParams(mode="coupled", temperature=1.0, seed=1)
    toks = draw(logits, params, torch.arange(20000), torch.zeros(20000, dtype=torch.long), None)
    freq = torch.bincount(toks, minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)


def test_rejection_draw_reproducible_with_generator():
    logits = torch.randn(8, 10)
    params = SamplingParams(mode="rejection")
    z = torch.zeros(8, dtype=torch.long)
    a = draw(logits, params, z, z, torch.Generator().manual_seed(5))
    b = draw(logits, params, z, z, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw,field", [(dict(mode="beam"), "mode"), (dict(temperature=0.0), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an int"),
    (dict(top_k=1.0), "top_k must be an int"),
    (dict(seed=True), "seed must be an int"),
    (dict(stop_on_eos=1), "stop_on_eos must be a bool"),
    (dict(temperature=0), "temperature must be > 0"),
    (dict(top_p=0.0), "top_p must be > 0"),
])
def test_sampling_params_refuse_wrong_types_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)
