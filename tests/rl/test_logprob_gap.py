"""The logprob_gap health metric: generation log-probs (the rollout engine's) against the
policy's of the same tokens, into the step record (mean |policy - generation| and NeMo-RL's
token_mult_prob_error = mean exp|policy - generation|)."""
from __future__ import annotations

import math

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.policy import PolicyConfig, build_policy_backend
from nemo_tlt.rl.reporting.logprob_gap import comparable, gap_metrics, gap_sums
from nemo_tlt.rl.reporting.records import IdleResult, RankState, RankStep, step_record
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import tiny_target


def test_sums_and_metrics_of_known_values():
    gen = [[-1.0, -2.0], [-0.5]]
    pol = [torch.tensor([-1.5, -2.0]), torch.tensor([0.0])]
    sums = gap_sums(gen, pol)
    assert sums["logprob_gap_tokens"] == 3.0 and sums["logprob_gap_abs_sum"] == pytest.approx(1.0)
    other = gap_sums([[-1.0]], [torch.tensor([-2.0])])  # a second rank
    got = gap_metrics([sums, other, {"loss": 0.0}])  # a rank without sums is skipped
    assert got["logprob_gap"] == pytest.approx(2.0 / 4)
    assert got["token_mult_prob_error"] == pytest.approx((2 * math.exp(0.5) + 1.0 + math.e) / 4)
    assert gap_metrics([{"loss": 0.0}]) == {"logprob_gap": None, "token_mult_prob_error": None}


def test_an_unreported_generation_logprob_is_left_out_and_shapes_must_agree():
    sums = gap_sums([[float("nan"), -1.0]], [torch.tensor([-3.0, -1.25])])
    assert sums["logprob_gap_tokens"] == 1.0 and sums["logprob_gap_abs_sum"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="sequence 0 has 2 generation log-probs, 1 policy"):
        gap_sums([[-1.0, -2.0]], [torch.tensor([-1.0])])
    with pytest.raises(ValueError, match="1 generation sequences, 2 policy"):
        gap_sums([[-1.0]], [torch.tensor([-1.0]), torch.tensor([-1.0])])


def test_greedy_is_compared_only_at_temperature_one():
    assert comparable("greedy", 1.0) and not comparable("greedy", 0.7)
    assert comparable("rejection", 0.7) and comparable("coupled", 1.3)


@pytest.mark.parametrize("mode", ["coupled", "rejection"])
def test_the_engine_and_the_policy_agree_at_the_same_temperature(mode):
    """Like with like: the engine samples at the policy's temperature (no top-k / top-p), with
    SD on; the metric is then fp32 rounding (gap ~1e-6, error ~1). At another temperature the
    policy's log-probs are another distribution's and the metric shows it."""
    target = tiny_target(seed=2)
    drafter = EagleDrafter(EagleConfig.from_target(target.config), generator=torch.Generator().manual_seed(1))
    engine = TorchRolloutEngine(target, drafter)
    reqs = [Request(tuple(range(3, 3 + n)), seq_id=i) for i, n in enumerate((4, 7, 5, 2))]
    out = engine.generate(reqs, SamplingParams(mode, temperature=0.7, max_new_tokens=16, seed=3),
                          policy=FixedSDPolicy(TreeShape(3, 2, 4)))
    assert out.stats.sd_steps > 0
    batch = [(list(r.prompt), res.tokens) for r, res in zip(reqs, out.results)]
    gen = [res.logprobs for res in out.results]
    weights = target.state_dict()
    same = build_policy_backend(PolicyConfig(), weights, target.config, temperature=0.7, seed=0)
    rec = gap_metrics([gap_sums(gen, same.logprobs(batch)[0])])
    assert rec["logprob_gap"] < 1e-5 and rec["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5)
    other = build_policy_backend(PolicyConfig(), weights, target.config, temperature=1.0, seed=0)
    assert gap_metrics([gap_sums(gen, other.logprobs(batch)[0])])["logprob_gap"] > 1e-2


def test_the_step_record_carries_the_metrics():
    base = {**dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "approx_kl"), 0.0), "grad_norm": 0.0, "loss_tokens": 2}
    ranks = [RankStep(rank=k, node=0, ids=[k], tokens=[[1, 2]], rewards=[1.0], gen_s=1.0, sd_steps=0, plain_steps=2,
                      accept_lengths=[], segments=[], idle=IdleResult(), state=RankState(), weights="w",
                      update={**base, **gap_sums([[-1.0, -2.0]], [torch.tensor([-1.0, -2.0 - k])])})
             for k in range(2)]
    times = {"step_s": 1.0, "rollout_s": 0.5, "logprob_s": 0.1, "update_s": 0.1, "weight_sync_s": 0.1}
    rec = step_record(0, "tlt", 2, ranks, times, [], 0.0, 1.0)
    assert rec["logprob_gap"] == pytest.approx(0.25)
    assert rec["token_mult_prob_error"] == pytest.approx((3 + math.e) / 4)
    ranks = [RankStep(**{**vars(r), "update": base}) for r in ranks]  # no separate log-prob pass
    rec = step_record(0, "tlt", 2, ranks, times, [], 0.0, 1.0)
    assert rec["logprob_gap"] is None and rec["token_mult_prob_error"] is None
