"""The suite's TensorRT-LLM harness (`engines.FollowingSchedule`), run here on the stand-in
TensorRT-LLM module (tests/trtllm_standin.py): the engine fixes its schedule per build and
refuses another, so the harness restarts it per call's policy and keeps the policy weights
across restarts; without it the suite's shape sweeps would be refused on a GPU node."""
from __future__ import annotations

import pytest

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from engines import _build_trtllm
import trtllm_standin
from tiny import tiny_config, tiny_target

REQS = [Request([3, 4]), Request([5, 6, 7])]
SP = SamplingParams(mode="greedy", max_new_tokens=10)


def _tokens(engine, policy=None):
    return [r.tokens for r in engine.generate(REQS, SP, policy=policy).results]


def test_the_harness_follows_each_calls_schedule_and_keeps_the_weights(monkeypatch, tmp_path):
    trtllm_standin.install(monkeypatch)
    first, other = tiny_target(num_layers=3, seed=3), tiny_target(num_layers=3, seed=8)
    folder = save_hf_folder(first, tmp_path / "t")
    drafter_dir = tmp_path / "d"
    drafter_dir.mkdir()
    write_eagle3_hf(Eagle3Drafter(Eagle3Config.from_target(tiny_config(num_layers=3))), drafter_dir)
    engine = _build_trtllm(folder, str(drafter_dir), (0, 1, 2))
    engine.load_policy_weights(other.state_dict())
    want = [r.tokens for r in TorchRolloutEngine(other).generate(REQS, SP).results]
    for depth in (3, 2, None, 4, 2):
        policy = None if depth is None else FixedSDPolicy(TreeShape(depth, 1, depth))
        assert _tokens(engine, policy) == want
        report = engine.engine.last_speculation
        assert (report is None) == (depth is None)
        if depth is not None:
            assert report.draft_tokens == depth * (report.iterations - report.requests)
    assert engine.restarts == 5  # built with {256: 4}: every call asked for another schedule
    assert _tokens(engine, FixedSDPolicy(TreeShape(2, 1, 2))) == want and engine.restarts == 5
    engine.load_drafter(None)
    with pytest.raises(ValueError, match="built without a drafter"):
        _tokens(engine, FixedSDPolicy(TreeShape(2, 1, 2)))
    assert _tokens(engine) == want
    engine.load_drafter(str(drafter_dir))
    assert _tokens(engine, FixedSDPolicy(TreeShape(3, 1, 3))) == want
