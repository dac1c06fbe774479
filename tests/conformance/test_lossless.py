"""Lossless SD: greedy and coupled outputs are those of plain decoding, whatever the
drafter, the tree shapes, the SD policy and the batch composition."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import DRAFTERS, requests, tokens

SHAPES = [TreeShape(1, 1, 1), TreeShape(3, 2, 5), TreeShape(4, 3, 12), TreeShape(2, 4, 20)]
ARMS = (TreeShape(2, 2, 3), TreeShape(3, 2, 6), TreeShape(4, 3, 10))


@pytest.fixture(scope="module")
def engines(make_engine, model_dir):
    """One engine decoding plainly, one drafting (drafters are swapped per test)."""
    return make_engine(model_dir), make_engine(model_dir)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("lengths", [[5], [3, 9, 1, 6]], ids=["batch1", "batch4"])
def test_fixed_trees_equal_plain(make_engine, engines, mode, kind, lengths):
    make_engine.require(mode=mode)
    plain, sd = engines
    sd.load_drafter(make_engine.drafter(kind, sd.model_config))
    reqs = requests(lengths, seed=len(lengths))
    sp = SamplingParams(mode=mode, temperature=0.8, top_k=20, max_new_tokens=24, seed=7, stop_on_eos=False)
    base = plain.generate(reqs, sp)
    for shape in SHAPES:
        out = sd.generate(reqs, sp, policy=FixedSDPolicy(shape))
        assert tokens(out) == tokens(base), (kind, shape)
        assert out.stats.sd_steps > 0 or not make_engine.spec.step_stats


@pytest.fixture(scope="module")
def long_tail():
    """24 prompts whose coupled samples are long-tailed: SD switches on as rows finish."""
    g = torch.Generator().manual_seed(0)
    return [Request(torch.randint(3, 32, (int(n),), generator=g).tolist(), seq_id=i)
            for i, n in enumerate(torch.randint(2, 9, (24,), generator=g))]


def _adaptive(seed: int = 0) -> AdaptiveSDPolicy:
    bandit = BegMab(BanditConfig(ARMS, (3, 6), epsilon=0.3), np.random.default_rng(seed))
    return AdaptiveSDPolicy(SDPolicyConfig(threshold_on=12, threshold_off=16), bandit)


def _learned() -> LearnedSDPolicy:
    # Collapse decided over 3 SD steps, not after one crowded one (collapse_rows): a weak
    # drafter then still runs every tree before the policy drops it, so the rollouts
    # switch between plain decoding and several trees.
    return LearnedSDPolicy(LearnedSDConfig(ARMS, min_pulls=1, probe_shortest=2, reprobe_shortest=4,
                                           collapse_rows=10_000))


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "oracle", "adversarial"])
@pytest.mark.parametrize("make_policy", [_adaptive, _learned], ids=["adaptive", "learned"])
def test_adaptive_policies_equal_plain(make_engine, engines, long_tail, mode, kind, make_policy):
    """The same policy across rollouts switches SD on and off and changes trees; the
    tokens stay the plain ones."""
    make_engine.require(mode=mode)
    plain, sd = engines
    sd.load_drafter(make_engine.drafter(kind, sd.model_config))
    sp = SamplingParams(mode=mode, temperature=1.0, max_new_tokens=60, seed=4)
    base = plain.generate(long_tail, sp)
    if mode == "coupled":
        lengths = sorted(len(t) for t in tokens(base))
        assert lengths[-1] >= 4 * lengths[len(lengths) // 2], "the workload must be long-tailed"
    if mode == "greedy":  # the rows that finish early and at most 12 others: a tail for _adaptive's threshold
        early = [i for i, t in enumerate(tokens(base)) if len(t) < sp.max_new_tokens]
        keep = sorted(early + [i for i in range(len(long_tail)) if i not in early][:12])
        long_tail, base = [long_tail[i] for i in keep], plain.generate([long_tail[i] for i in keep], sp)
    policy, ran = make_policy(), []
    for _ in range(3):
        out = sd.generate(long_tail, sp, policy=policy)
        assert tokens(out) == tokens(base)
        ran += [step.shape for step in out.stats.trace]
    if not make_engine.spec.step_stats:
        return
    assert None in ran and len({s for s in ran if s}) >= 2, "plain steps and several trees should have run"


@pytest.mark.parametrize("policy", [None, FixedSDPolicy(TreeShape(3, 2, 6)), FixedSDPolicy(TreeShape(1, 1, 1))],
                         ids=["plain", "tree_3_2_6", "chain_1"])
def test_coupled_tokens_do_not_depend_on_the_batch(make_engine, engines, policy):
    """A request's coupled sample depends on (seed, seq_id) only: alone, in another
    batch or in another order it is the same, with or without SD."""
    make_engine.require(mode="coupled")
    plain, sd = engines
    sd.load_drafter(make_engine.drafter("oracle", sd.model_config))
    engine = plain if policy is None else sd
    reqs = requests([4, 9, 2, 6, 3, 7], seed=5)
    sp = SamplingParams(mode="coupled", temperature=1.0, max_new_tokens=30, seed=21)
    together = dict(zip(reqs, tokens(engine.generate(reqs, sp, policy=policy))))
    reordered = reqs[::-1][:4]
    assert tokens(engine.generate(reordered, sp, policy=policy)) == [together[r] for r in reordered]
    for r in reqs[:3]:
        assert tokens(engine.generate([r], sp, policy=policy)) == [together[r]]
    assert tokens(plain.generate(reqs, sp)) == [together[r] for r in reqs]
