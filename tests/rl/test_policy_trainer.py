"""PolicyTrainer: one optimizer step per batch, so the old log-probs may come from
the update's own forward (logp_old=None) instead of a separate pass."""
from __future__ import annotations

import torch

from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rl.policy import PolicyConfig, PolicyTrainer
from tiny import tiny_config


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = [(torch.randint(3, 32, (int(p),), generator=g).tolist(), torch.randint(3, 32, (int(r),), generator=g).tolist())
             for p, r in zip(torch.randint(2, 6, (6,), generator=g), torch.randint(1, 12, (6,), generator=g))]
    return batch, torch.randn(6, generator=g)


def _trainer(kl_coef: float = 0.0) -> PolicyTrainer:
    model = DecoderLM(tiny_config()).init_weights_(torch.Generator().manual_seed(0))
    return PolicyTrainer(model, PolicyConfig(lr=1e-3, micro_batch=4, kl_coef=kl_coef, temperature=0.8))


def test_update_without_a_logprob_pass_matches_the_separate_pass():
    batch, adv = _batch(1)
    tokens = sum(len(r) for _, r in batch)
    a, b = _trainer(kl_coef=0.05), _trainer(kl_coef=0.05)
    old, ref = a.logprobs(batch)
    sa = a.update(batch, adv, old, ref, tokens)
    none_old, ref_b = b.logprobs(batch, current=False)
    assert none_old is None and ref_b is not None
    sb = b.update(batch, adv, None, ref_b, tokens)
    assert sb["clip_frac"] == 0.0 and sb["approx_kl"] == 0.0
    for key in ("loss", "pg_loss", "kl", "grad_norm"):
        assert abs(sa[key] - sb[key]) <= 1e-5 * max(1.0, abs(sa[key])), key
    moved = 0.0
    for (name, pa), pb, p0 in zip(a.model.named_parameters(), b.model.parameters(), _trainer().model.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((pa - p0).abs().max()))
    assert moved > 1e-4  # the step is far larger than the tolerance


def test_no_reference_and_no_current_pass_returns_nothing():
    batch, _ = _batch(2)
    assert _trainer().logprobs(batch, current=False) == (None, None)
