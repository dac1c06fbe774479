"""The RL algorithms behind ``RLAlgorithm``: DAPO and RLOO against independent reference
computations (plain Python over the rewards), and the ``counted`` contract of both policy
backends: dropping sequences is training on the others alone."""
from __future__ import annotations

import statistics

import pytest
import torch

from nemo_tlt.algorithms.dapo import DAPO
from nemo_tlt.algorithms.grpo import GRPO, group_advantages
from nemo_tlt.algorithms.loss import kl_penalty
from nemo_tlt.algorithms.protocol import Outcomes, RLAlgorithm, counted_kwarg
from nemo_tlt.algorithms.registry import ALGORITHMS, build_algorithm
from nemo_tlt.algorithms.rloo import RLOO
from nemo_tlt.config import load_config
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig
from nemo_tlt.policy.batching import micro_batches, padded
from nemo_tlt.policy.megatron_forward import policy_loss_fn
from nemo_tlt.policy.torch_backend import TorchPolicy
from tiny import tiny_config

EOS, LIMIT = 2, 6


def _outcomes(rewards: list[list[float]], lengths: list[list[int]], eos_at_end: list[list[bool]]) -> Outcomes:
    responses = [[5] * (n - 1) + [EOS if eos else 7] for row_n, row_e in zip(lengths, eos_at_end)
                 for n, eos in zip(row_n, row_e)]
    return Outcomes.of([r for row in rewards for r in row], responses, len(rewards[0]), LIMIT, EOS)


def test_the_registry_names_the_built_in_algorithms_and_builds_them():
    assert ALGORITHMS.names() == ("grpo", "dapo", "rloo")
    assert isinstance(build_algorithm("dapo", {"clip_eps_high": 0.3}), DAPO)
    assert all(isinstance(build_algorithm(n), RLAlgorithm) for n in ALGORITHMS.names())


def test_truncated_means_stopped_at_the_limit_without_eos():
    o = _outcomes([[1.0, 0.0, 0.0]], [[LIMIT, LIMIT, 3]], [[True, False, False]])
    assert o.truncated.tolist() == [[False, True, False]] and o.lengths.tolist() == [[LIMIT, LIMIT, 3]]


def test_rloo_is_each_reward_minus_the_mean_of_the_others():
    rewards = [[1.0, 0.0, 0.5, 0.25], [0.3, 0.3, 0.3, 0.3], [2.0, -1.0, 0.0, 1.0]]
    o = _outcomes(rewards, [[3] * 4] * 3, [[True] * 4] * 3)
    adv = RLOO().advantages(o)
    want = [r - statistics.fmean(row[:i] + row[i + 1:]) for row in rewards for i, r in enumerate(row)]
    assert adv.values.tolist() == pytest.approx(want, abs=1e-6)
    assert adv.values[4:8].tolist() == [0.0] * 4  # equal rewards: exactly 0
    assert adv.counted.all() and adv.tokens == 36


def test_rloo_refuses_a_group_of_one():
    with pytest.raises(ValueError, match="grpo.group_size >= 2"):
        RLOO().advantages(_outcomes([[1.0]], [[3]], [[True]]))
    with pytest.raises(ValueError, match="grpo.group_size >= 2"):
        load_config(None, ["algorithm=rloo", "grpo.group_size=1"])


def _dapo_reference(rewards, lengths, truncated, buffer, factor, overlong_filter, dynamic):
    """DAPO's advantages and counted flags, written out per group in plain Python."""
    values, counted = [], []
    for row_r, row_n, row_t in zip(rewards, lengths, truncated):
        shaped = []
        for r, n in zip(row_r, row_n):
            start = LIMIT - buffer
            penalty = 0.0 if buffer == 0 or n <= start else -factor * min((n - start) / buffer, 1.0)
            shaped.append(r + penalty)
        mean, std = statistics.fmean(shaped), statistics.stdev(shaped)
        uniform = max(shaped) == min(shaped)
        for s, t in zip(shaped, row_t):
            keep = not (overlong_filter and t) and not (dynamic and uniform)
            counted.append(keep)
            values.append((0.0 if uniform else (s - mean) / (std + 1e-6)) if keep else 0.0)
    return values, counted


@pytest.mark.parametrize("buffer,factor,overlong_filter,dynamic",
                         [(0, 1.0, True, True), (3, 0.5, True, False), (2, 1.0, False, True), (0, 1.0, False, False)])
def test_dapo_matches_a_reference_computation(buffer, factor, overlong_filter, dynamic):
    rewards = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]
    lengths = [[2, 6, 5, 4], [3, 3, 3, 3], [6, 6, 1, 6], [2, 4, 5, 6]]
    eos = [[True, False, True, True], [True] * 4, [False, True, True, False], [True, True, True, True]]
    o = _outcomes(rewards, lengths, eos)
    algo = DAPO(overlong_filter=overlong_filter, dynamic_sampling=dynamic, overlong_buffer=buffer,
                overlong_penalty=factor)
    adv = algo.advantages(o)
    values, counted = _dapo_reference(rewards, lengths, o.truncated.tolist(), buffer, factor, overlong_filter,
                                      dynamic)
    assert adv.counted.tolist() == counted
    assert adv.values.tolist() == pytest.approx(values, abs=1e-5)
    assert adv.tokens == sum(n for n, c in zip([n for row in lengths for n in row], counted) if c)


def test_dapo_drops_groups_without_signal_and_truncated_rows_by_default():
    o = _outcomes([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], [[LIMIT, 2, 3], [1, 1, 1]], [[False, True, True]] + [[True] * 3])
    adv = DAPO().advantages(o)
    assert adv.counted.tolist() == [False, True, True, False, False, False]
    assert adv.tokens == 5 and counted_kwarg(adv)["counted"] is adv.counted
    assert counted_kwarg(GRPO().advantages(o)) == {}  # every row counts: the plain update path


def test_grpo_is_group_advantages():
    rewards = [[1.0, 0.0, 0.5, 0.25], [0.2, 0.9, 0.9, 0.1]]
    o = _outcomes(rewards, [[3] * 4] * 2, [[True] * 4] * 2)
    assert torch.equal(GRPO().advantages(o).values, group_advantages(torch.tensor(rewards), 4).reshape(-1))


def test_dapo_clips_higher_than_grpo():
    # ratio 1.25 with a positive advantage: clipped by GRPO's symmetric 0.2, not by DAPO's 0.28
    logp_old = torch.zeros(1, 2)
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    for algo, grad in ((GRPO(), 0.0), (DAPO(), 1.25 / 2)):
        logp_new = torch.full((1, 2), torch.log(torch.tensor(1.25)).item(), requires_grad=True)
        loss, _ = algo.policy_loss(logp_new, logp_old, adv, mask, clip_eps=0.2)
        loss.backward()
        assert logp_new.grad.reshape(-1).tolist() == pytest.approx([-grad, -grad])


def test_options_are_checked_by_name():
    with pytest.raises(ValueError, match="algorithm_options.clip_eps_high must be > 0"):
        load_config(None, ["algorithm=dapo", "algorithm_options.clip_eps_high=0"])
    with pytest.raises(ValueError, match="algorithm_options: the 'rloo' algorithm does not take"):
        load_config(None, ["algorithm=rloo", "algorithm_options.clip_eps_high=0.3"])
    with pytest.raises(ValueError, match="algorithm_options.overlong_buffer=500 is longer than grpo.max_new_tokens"):
        load_config(None, ["algorithm=dapo", "algorithm_options.overlong_buffer=500"])
    with pytest.raises(ValueError, match=r"algorithm must be one of \['grpo', 'dapo', 'rloo'\]"):
        load_config(None, ["algorithm=ppo"])


# ---- the backends' ``counted``: dropping rows is training on the others alone -------------------

def _batch():
    g = torch.Generator().manual_seed(3)
    batch = [(torch.randint(3, 32, (3,), generator=g).tolist(), torch.randint(3, 32, (n,), generator=g).tolist())
             for n in (4, 7, 2, 9, 5, 6)]
    return batch, torch.randn(6, generator=g), torch.tensor([True, False, True, True, False, True])


def _policy(algorithm, kl_coef=0.05, lr=1e-3):
    model = DecoderLM(tiny_config()).init_weights_(torch.Generator().manual_seed(0))
    config = PolicyConfig(micro_batch=6, kl_coef=kl_coef, optim=PolicyOptimConfig(lr=lr))
    return TorchPolicy(model, config, temperature=0.8, algorithm=algorithm)


def _warmed(batch, adv):
    """A policy one large step away from its KL reference, and the log-probs from before that
    step: the update after it has a ratio off 1 (DAPO's clips apply) and a non-zero KL."""
    policy = _policy(DAPO(), lr=0.05)
    stale, ref = policy.logprobs(batch)
    policy.update(batch, -adv, stale, ref, sum(len(r) for _, r in batch))
    return policy, stale


def _assert_same_weights(a, b):
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("pipelined", [False, True], ids=["update", "accumulate"])
def test_torch_backend_counted_rows_equal_training_on_them_alone(pipelined):
    batch, adv, counted = _batch()
    keep = [i for i in range(len(batch)) if counted[i]]
    tokens = sum(len(batch[i][1]) for i in keep)
    runs = []
    for sub in (False, True):
        policy, stale = _warmed(batch, adv)
        _, ref = policy.logprobs(batch, current=False)
        rows, a, old, c = batch, adv, stale, {"counted": counted}
        if sub:
            rows, a, old, ref, c = [batch[i] for i in keep], adv[keep], [stale[i] for i in keep], \
                [ref[i] for i in keep], {}
        if pipelined:
            policy.begin_accumulation(10 * tokens)
            sums = policy.accumulate(rows, a, old, ref, **c)
            stats = {**{k: sums[k] / tokens for k in ("loss", "kl", "clip_frac")}, **policy.apply_accumulated(tokens)}
            assert sums["tokens"] == tokens
        else:
            stats = policy.update(rows, a, old, ref, tokens, **c)
        runs.append((policy, stats))
    (a, sa), (b, sb) = runs
    assert sa["kl"] > 0 and sa["clip_frac"] > 0  # the KL term and the clips are in play
    for key in ("loss", "kl", "clip_frac", "grad_norm"):
        assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-7), key
    _assert_same_weights(a, b)


def test_megatron_loss_counts_only_counted_rows():
    """The megatron backend's per-micro-batch loss, fed log-probs directly."""
    batch, adv, counted = _batch()
    (mb,) = micro_batches(batch, 6)
    g = torch.Generator().manual_seed(5)
    new = (torch.randn(mb.mask.shape, generator=g) * 0.1 - 2.0).requires_grad_(True)
    old = [torch.randn(len(r), generator=g) * 0.1 - 2.0 for _, r in batch]
    ref = [torch.randn(len(r), generator=g) * 0.1 - 2.0 for _, r in batch]
    tokens = int(sum(len(r) for (_, r), c in zip(batch, counted) if c))
    totals = torch.zeros(5, dtype=torch.float64)
    fn = policy_loss_fn(mb, adv, old, ref, tokens, totals, None, device=torch.device("cpu"),
                        token_logprobs=lambda out, ids: out, algorithm=DAPO(), clip_eps=0.2, kl_coef=0.1,
                        counted=counted)
    loss, _ = fn(new)
    loss.backward()
    rows = mb.index.tolist()
    keep = torch.tensor([bool(counted[i]) for i in rows])
    mask = mb.mask * keep.unsqueeze(1)
    pg, _ = DAPO().policy_loss(new.detach(), padded([old[i] for i in rows], mb.mask), adv[mb.index], mask, 0.2)
    kl = kl_penalty(new.detach(), padded([ref[i] for i in rows], mb.mask), mask)
    assert float(kl) > 0 and float(loss) == pytest.approx(float(pg + 0.1 * kl), rel=1e-6)
    assert new.grad[~keep].abs().sum() == 0 and new.grad[keep].abs().sum() > 0


def test_a_step_with_every_row_dropped_has_a_zero_gradient():
    batch, adv, _ = _batch()
    policy = _policy(DAPO(), kl_coef=0.05)
    old, ref = policy.logprobs(batch)
    stats = policy.update(batch, adv, old, ref, 1, counted=torch.zeros(len(batch), dtype=torch.bool))
    assert stats["grad_norm"] == 0.0 and stats["loss"] == 0.0 and stats["kl"] == 0.0
