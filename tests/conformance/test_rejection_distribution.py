"""Rejection-mode SD samples exactly the target's distribution.

A tiny-vocabulary target's joint distribution of the first three sampled tokens
is computed exactly by enumeration; 12k SD rollouts are compared with it by a
chi-square goodness-of-fit test, with a good (oracle) and a bad (adversarial)
drafter. A deliberately broken acceptance rule in the torch engine (no residual
update after a rejection) must be detected, which shows the test has teeth. An engine
that declares no rejection top-k while it can speculate (``EngineSpec.sd_top_k``) samples
without top-k here (temperature kept), the exact joint computed for the same sampling.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import nemo_tlt.rollout.torch_engine as engine_mod
from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.rollout.protocol import GenerationStats, Request, RolloutEngine
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.acceptance import accept_rejection
from nemo_tlt.speculative.sampling import SamplingParams, process_logits
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import OracleDrafter, tiny_target

V, STEPS, N = 6, 3, 12000
PROMPT = (3, 1, 4)
SAMPLING = SamplingParams(mode="rejection", temperature=0.9, top_k=5, max_new_tokens=STEPS,
                          seed=123, stop_on_eos=False)


def exact_joint(target, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    seqs = list(itertools.product(range(V), repeat=STEPS))
    ids = torch.tensor([PROMPT + s for s in seqs])
    with torch.no_grad():
        logp = process_logits(target(ids)[:, len(PROMPT) - 1: -1], sampling)
    picked = logp.gather(2, ids[:, len(PROMPT):, None]).squeeze(-1).sum(1).exp()
    return {s: float(p) for s, p in zip(seqs, picked)}


def chi2_pvalue(engine: RolloutEngine, target, drafter, shape,
                sampling: SamplingParams = SAMPLING) -> tuple[float, GenerationStats]:
    """The chi-square p-value of N rollouts against the exact joint, and their stats."""
    joint = exact_joint(target, sampling)
    engine.load_drafter(drafter)
    out = engine.generate([Request(PROMPT, seq_id=i) for i in range(N)], sampling,
                          policy=FixedSDPolicy(shape) if drafter is not None else None)
    counts: dict[tuple[int, ...], int] = {}
    for r in out.results:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    # pool cells with small expectation into one, so the chi-square approximation holds
    impossible = sum(c for k, c in counts.items() if joint[k] == 0.0)
    if impossible:  # a token outside top-k was produced
        return 0.0, out.stats
    keys = sorted((k for k in joint if joint[k] > 0), key=joint.get, reverse=True)
    big = [k for k in keys if joint[k] * N >= 5]
    small = [k for k in keys if joint[k] * N < 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [joint[k] * N for k in big]
    if small:
        obs.append(sum(counts.get(k, 0) for k in small))
        exp.append(sum(joint[k] for k in small) * N)
    return float(chisquare(np.array(obs), np.array(exp) * sum(obs) / sum(exp)).pvalue), out.stats


def _small_target(**shape):
    fields = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return tiny_target(seed=3, scale=3.0, **{**fields, **shape})


@pytest.fixture(scope="module")
def small_target(make_engine):
    return _small_target(**{k: v for k, v in make_engine.spec.model_shape.items() if k != "vocab_size"})


@pytest.fixture(scope="module")
def sampling(make_engine) -> SamplingParams:
    """SAMPLING, without top-k where the engine declares none while it can speculate."""
    return SAMPLING if make_engine.spec.sd_top_k else dataclasses.replace(SAMPLING, top_k=0)


@pytest.fixture(scope="module")
def small_dir(small_target, tmp_path_factory):
    return save_hf_folder(small_target, tmp_path_factory.mktemp("rejection") / "target")


def test_plain_sampling_matches_exact(make_engine, small_dir, small_target, sampling):
    assert chi2_pvalue(make_engine(small_dir), small_target, None, None, sampling)[0] > 1e-3


@pytest.mark.parametrize("kind", ["oracle", "adversarial", "eagle3"],
                         ids=["good_drafter", "bad_drafter", "eagle3_drafter"])
def test_rejection_sd_matches_exact(make_engine, small_dir, small_target, sampling, kind):
    engine = make_engine(small_dir)
    drafter = make_engine.drafter(kind, engine.model_config)
    pvalue, stats = chi2_pvalue(engine, small_target, drafter, TreeShape(2, 2, 4), sampling)
    assert pvalue > 1e-3
    if make_engine.spec.step_stats:
        assert stats.sd_steps > 0 and stats.mean_accept_len > 1.0, stats.mean_accept_len
    elif make_engine.spec.accept_stats:  # speculation ran (and accepted drafts) without per-step stats
        assert stats.accept_lengths and stats.mean_accept_len > 1.0, stats.mean_accept_len


@pytest.mark.parametrize("adversarial", [False, True], ids=["good_drafter", "bad_drafter"])
def test_broken_rule_is_detected(tmp_path, monkeypatch, adversarial):
    """The test's power, shown on the torch engine (whose acceptance rule can be broken)."""
    target = _small_target()
    engine = TorchRolloutEngine.from_hf_folder(save_hf_folder(target, tmp_path / "target"))
    broken = functools.partial(accept_rejection, residual_update=lambda r, tok: r)
    monkeypatch.setattr(engine_mod, "accept_rejection", broken)
    assert chi2_pvalue(engine, target, OracleDrafter(adversarial), TreeShape(2, 2, 4))[0] < 1e-6
