"""The engine in bf16 on the CPU: plain and speculative decoding run and stay lossless
where the measurements say they do (docs/benchmarks.md, "Precision").

* bf16 weights computed in fp32 (``compute_dtype=torch.float32``,
  ``rollout.compute_dtype=float32``): SD is token-identical to plain decoding, greedy
  and coupled, as in fp32.
* plain bf16: everything runs, tokens are valid and stop where they should; identity
  with plain decoding is not promised (verification and plain decoding round in bf16
  along different reduction orders, so near-ties can flip).
"""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import ragged_requests, seeded_drafter, tiny_target

SHAPE = TreeShape(4, 2, 8)


def _bf16_target():
    return tiny_target(seed=2).to(torch.bfloat16)


_drafter, _requests = seeded_drafter, ragged_requests


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_bf16_weights_computed_in_fp32_keep_sd_token_identical(kind, mode):
    target = _bf16_target()
    drafter = _drafter(kind, target.config)  # fp32 master weights serving a bf16 target
    sampling = SamplingParams(mode, max_new_tokens=40, seed=7)
    plain = TorchRolloutEngine(target, compute_dtype=torch.float32)
    sd = TorchRolloutEngine(target, drafter, compute_dtype=torch.float32)
    assert plain.compute_dtype == torch.float32 and plain.weights_dtype == torch.bfloat16
    reqs = _requests()
    want = [r.tokens for r in plain.generate(reqs, sampling).results]
    out = sd.generate(reqs, sampling, policy=FixedSDPolicy(SHAPE))
    assert out.stats.sd_steps > 0
    assert [r.tokens for r in out.results] == want
    assert target.lm_head_weight.dtype == torch.bfloat16  # the caller's model is left as it was


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_plain_bf16_runs_plain_and_speculative_with_valid_tokens(kind, mode):
    target = _bf16_target()
    sampling = SamplingParams(mode, max_new_tokens=30, seed=7)
    vocab, eos = target.config.vocab_size, target.config.eos_token_id
    for engine, policy in ((TorchRolloutEngine(target), None),
                           (TorchRolloutEngine(target, _drafter(kind, target.config)), FixedSDPolicy(SHAPE))):
        out = engine.generate(_requests(), sampling, policy=policy, return_hidden=True)
        assert (out.stats.sd_steps > 0) == (policy is not None)
        for res, req in zip(out.results, _requests()):
            assert 1 <= len(res.tokens) <= 30 and all(0 <= t < vocab for t in res.tokens)
            assert (res.stop_reason == "eos") == (res.tokens[-1] == eos)
            assert eos not in res.tokens[:-1]
            assert res.hidden_states.dtype == torch.bfloat16
            assert res.hidden_states.shape[0] == len(req.prompt) + len(res.tokens) - 1


def test_policy_weights_are_served_rounded_to_the_model_dtype():
    target = _bf16_target()
    engine = TorchRolloutEngine(target, compute_dtype=torch.float32)
    fresh = tiny_target(seed=5)  # fp32 weights, not bf16-representable
    engine.load_policy_weights(fresh.state_dict())
    for name, p in engine.target.state_dict().items():
        assert p.dtype == torch.float32
        assert torch.equal(p, fresh.state_dict()[name].to(torch.bfloat16).float()), name


def test_rollout_compute_dtype_key():
    assert RolloutConfig().engine_compute_dtype is None
    assert RolloutConfig(compute_dtype="float32").engine_compute_dtype == torch.float32
    with pytest.raises(ValueError, match="RolloutConfig.compute_dtype"):
        RolloutConfig(compute_dtype="bfloat16")
