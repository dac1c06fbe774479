"""`nemo-tlt bench precision`'s pieces on a tiny target (the full run: docs/benchmarks.md)."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.bench.precision import exact_topk_joint, identity_rate, parse_args
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams, process_logits
from tiny import tiny_target


def test_identity_rate_counts_whole_sequences():
    assert identity_rate([[1, 2], [3], [4]], [[1, 2], [3, 5], [4]]) == pytest.approx(2 / 3)


def test_exact_topk_joint_is_a_distribution_with_the_targets_marginal():
    target = tiny_target(seed=1)
    engine = TorchRolloutEngine(target)
    sampling = SamplingParams("rejection", top_k=3, max_new_tokens=2)
    prompt = (3, 5, 7)
    joint = exact_topk_joint(engine, prompt, sampling, steps=2)
    assert len(joint) == 9 and sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    with torch.no_grad():
        first = process_logits(target(torch.tensor([prompt]))[0, -1], sampling).exp()
    for tok in range(target.config.vocab_size):
        marginal = sum(p for k, p in joint.items() if k[0] == tok)
        assert marginal == pytest.approx(float(first[tok]), abs=1e-5)


def test_parse_args_refuses_unknown_configs():
    assert parse_args(["--out", "x.json"]).config_names == ["float32", "bfloat16", "bfloat16_compute_float32"]
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--configs", "float16"])
