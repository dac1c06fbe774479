"""Log-probs: every result carries one per generated token, the target's log-probability
of that token under the sampling transform used (``speculative.sampling.token_logprobs``);
with SD they come from the verify forward and equal plain decoding's, and both equal an
independent recomputation: one full forward of the reference model over prompt + tokens."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.rollout.protocol import GenerateOutput, Request
from nemo_tlt.speculative.sampling import SamplingParams, token_logprobs
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import requests, tokens

SHAPES = [TreeShape(3, 2, 5), TreeShape(4, 3, 12), TreeShape(4, 1, 4)]
SAMPLINGS = {"t0.8-topk20": dict(temperature=0.8, top_k=20), "t1.3-topp0.9": dict(temperature=1.3, top_p=0.9)}


@pytest.fixture(scope="module")
def engines(make_engine, model_dir):
    """One engine decoding plainly, one drafting."""
    return make_engine(model_dir), make_engine(model_dir)


def recomputed(reference, req: Request, generated: list[int], sampling: SamplingParams) -> torch.Tensor:
    """The log-probs of `generated` from one fp32 forward of the reference over prompt + generated."""
    ids = torch.tensor([list(req.prompt) + generated], dtype=torch.long)
    with torch.no_grad():
        logits = reference.logits(reference.hidden(ids))[0, len(req.prompt) - 1: -1]
    return token_logprobs(logits, sampling, torch.tensor(generated, dtype=torch.long))


def check_against_reference(out: GenerateOutput, reqs: list[Request], reference, sampling: SamplingParams,
                            atol: float) -> float:
    worst = 0.0
    for req, res in zip(reqs, out.results):
        assert len(res.logprobs) == len(res.tokens)
        assert all(isinstance(x, float) for x in res.logprobs)
        got = torch.tensor(res.logprobs, dtype=torch.float32)
        want = recomputed(reference, req, res.tokens, sampling)
        assert torch.isfinite(got).all(), res.logprobs
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        worst = max(worst, float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize("setting", list(SAMPLINGS))
@pytest.mark.parametrize("mode", ["greedy", "rejection", "coupled"])
@pytest.mark.parametrize("kind", ["eagle3", "oracle", "adversarial"])
def test_sd_logprobs_equal_plain_and_a_full_forward(make_engine, engines, reference, mode, kind, setting):
    make_engine.require(mode=mode, top_k=SAMPLINGS[setting].get("top_k", 0) > 0)
    plain, sd = engines
    sd.load_drafter(make_engine.drafter(kind, sd.model_config))
    atol = make_engine.spec.logprobs_atol
    reqs = requests([3, 9, 1, 6], seed=5)
    sp = SamplingParams(mode=mode, max_new_tokens=24, seed=11, **SAMPLINGS[setting])
    base = plain.generate(reqs, sp)
    check_against_reference(base, reqs, reference, sp, atol)
    assert base.logprobs_from == "engine"
    for shape in SHAPES:
        out = sd.generate(reqs, sp, policy=FixedSDPolicy(shape))
        assert out.stats.sd_steps > 0 or not make_engine.spec.step_stats
        if not make_engine.spec.sd_logprobs:  # declared: none reported, and said so
            assert out.logprobs_from == "none"
            assert all(len(r.logprobs) == len(r.tokens) and all(x != x for x in r.logprobs) for r in out.results)
            continue
        assert out.logprobs_from == "engine"
        check_against_reference(out, reqs, reference, sp, atol)
        if mode != "rejection":  # the same tokens: the same log-probs
            assert tokens(out) == tokens(base)
            for a, b in zip(out.results, base.results):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


def test_greedy_logprobs_are_the_raw_log_softmax(make_engine, engines, reference):
    """Greedy has no distribution of its own: its tokens are reported with the log-softmax
    of the raw logits (temperature 1, no filter), whatever temperature / top-k is set."""
    plain, _ = engines
    reqs = requests([4, 7], seed=6)
    sp = SamplingParams(mode="greedy", temperature=0.5, top_k=3, max_new_tokens=12)
    out = plain.generate(reqs, sp)
    check_against_reference(out, reqs, reference, SamplingParams(mode="greedy"), make_engine.spec.logprobs_atol)
    for req, res in zip(reqs, out.results):
        raw = recomputed(reference, req, res.tokens, SamplingParams(mode="rejection"))
        torch.testing.assert_close(torch.tensor(res.logprobs), raw, atol=make_engine.spec.logprobs_atol, rtol=0)
