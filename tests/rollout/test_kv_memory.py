"""The torch engine's KV memory over a long-tailed adaptive rollout: it never grows
while rows finish, and a cache that starts small grows only with the longest row.
(That such rollouts are lossless is checked in tests/conformance.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, SDPolicyConfig
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import tiny_target

ARMS = (TreeShape(2, 2, 3), TreeShape(3, 2, 6), TreeShape(4, 3, 10))


def _policy(seed=0):
    bandit = BegMab(BanditConfig(ARMS, (3, 6), epsilon=0.3), np.random.default_rng(seed))
    return AdaptiveSDPolicy(SDPolicyConfig(threshold_on=12, threshold_off=16), bandit)


@pytest.fixture(scope="module")
def rollout():
    target = tiny_target(seed=3, scale=5.0)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(3, 32, (int(n),), generator=g).tolist(), seq_id=i)
            for i, n in enumerate(torch.randint(2, 9, (24,), generator=g))]
    return target, reqs


def test_kv_memory_is_bounded(rollout):
    target, reqs = rollout
    sp = SamplingParams(mode="coupled", temperature=1.0, max_new_tokens=60, seed=4)
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    out = TorchRolloutEngine(target, drafter).generate(reqs, sp, policy=_policy())
    kv = [t.kv_bytes for t in out.stats.trace]
    assert kv[0] > 0
    assert all(b <= a for a, b in zip(kv, kv[1:])), "KV bytes must never grow while no row outgrows the cache"
    # finished rows give their cache back: rows move in place until at most half of
    # the allocation is live, then to a buffer of their own size (within 2x)
    per_row0 = kv[0] / out.stats.trace[0].running
    assert all(t.kv_bytes < 2 * per_row0 * t.running for t in out.stats.trace)
    assert kv[-1] < kv[0]


def test_cache_starts_small_and_grows_with_the_longest_row(rollout):
    """With 4 initial slots past the prompts the cache regrows as rows lengthen; the
    outputs do not change, and the memory held stays within 2x (rows) x 2x (slots) of
    what the running rows use."""
    target, reqs = rollout
    sp = SamplingParams(mode="coupled", temperature=1.0, max_new_tokens=60, seed=4)
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    full = TorchRolloutEngine(target, drafter, initial_slots=None).generate(reqs, sp, policy=_policy())
    small = TorchRolloutEngine(target, drafter, initial_slots=4).generate(reqs, sp, policy=_policy())
    assert [r.tokens for r in small.results] == [r.tokens for r in full.results]
    kv = [t.kv_bytes for t in small.stats.trace]
    assert kv[0] < full.stats.trace[0].kv_bytes / 4
    assert any(b > a for a, b in zip(kv, kv[1:])), "the cache should have grown"
    c = target.config
    slot_bytes = 2 * (c.num_layers + 1) * c.num_kv_heads * c.head_dim * 4   # target + drafter, K and V
    slack = max(max(a.num_verify + 1, (a.depth - 1) * a.topk + 1) for a in ARMS) + 2   # one step's writes
    per_step = max(a.depth for a in ARMS) + 1                                        # most tokens a row gains
    longest = max(len(r.prompt) for r in reqs) + 1
    for t in small.stats.trace:
        need = longest + slack          # no row is longer than `longest` before this step
        assert t.kv_bytes <= 2 * 2 * t.running * need * slot_bytes
        longest = min(longest + per_step, max(len(r.prompt) for r in reqs) + sp.max_new_tokens)
