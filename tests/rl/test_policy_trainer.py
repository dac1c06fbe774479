"""PolicyTrainer: one optimizer step per batch, so the old log-probs may come from
the update's own forward (logp_old=None) instead of a separate pass."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_patches.gloo_launch import run_gloo
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rl.policy import PolicyConfig, PolicyTrainer
from tiny import tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from policy_dp_workers import data_parallel_update, update_with_grads  # noqa: E402


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


@pytest.mark.timeout(180)
def test_data_parallel_gradient_is_the_full_batch_gradient():
    """Two replicas, each on half the batch, with the RL loop's gradient all-reduce, against
    one replica on the whole batch: the gradients clipping sees (and so the grad norm) must
    agree, not only the AdamW step, which is blind to a constant scale of the gradient."""
    batch, adv = _batch(3)
    cfg = tiny_config()
    weights = DecoderLM(cfg).init_weights_(torch.Generator().manual_seed(3)).state_dict()
    policy = PolicyConfig(lr=1e-3, micro_batch=2, kl_coef=0.05, grad_clip=0.5)
    single = DecoderLM(cfg)
    single.load_state_dict(weights)
    want = update_with_grads(PolicyTrainer(single, policy), batch, adv, sum(len(r) for _, r in batch))
    shards = ((0, 2, 4), (1, 3, 5))
    ranks = run_gloo(data_parallel_update, 2, cfg, weights, policy, batch, adv, shards, timeout_s=150)
    assert want["stats"]["grad_norm"] > policy.grad_clip  # clipping is active: the norm must be global
    for got in ranks:
        assert got["stats"]["grad_norm"] == pytest.approx(want["stats"]["grad_norm"], rel=1e-5)
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-5, msg=name)
    # each replica's loss is its share of the global token mean: the shares sum to the whole
    for key in ("loss", "pg_loss", "kl"):
        assert sum(r["stats"][key] for r in ranks) == pytest.approx(want["stats"][key], rel=1e-5, abs=1e-7), key
