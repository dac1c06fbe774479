"""``drafter.serve_dtype``: the engine serves the drafter in that dtype while the idle-time
trainer keeps fp32 master weights; the served copy follows the masters at every hand-over,
and speculative decoding stays token-identical to plain decoding whatever the drafter's dtype."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.config import load_config
from nemo_tlt.drafter.io import save_drafter
from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.rl.idle_drafter import IdleDrafter
from nemo_tlt.rl.reporting.records import IdleResult
from nemo_tlt.rl.weight_stream import sync_weights
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.spot.config import IdleDrafterConfig
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import ragged_requests, seeded_drafter, tiny_target

DEMO = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
SHAPE = TreeShape(4, 2, 8)


_drafter, _requests = seeded_drafter, ragged_requests


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_serve_dtype_is_a_checked_setting():
    assert IdleDrafterConfig().serve_dtype == "float32"
    assert load_config(DEMO, ["drafter.serve_dtype=bfloat16"]).drafter.serve_dtype == "bfloat16"
    with pytest.raises(ValueError, match="IdleDrafterConfig.serve_dtype must be one of float32, bfloat16"):
        IdleDrafterConfig(serve_dtype="float16")
    # vLLM builds its drafter in the target's dtype: another serve dtype is refused by its key
    with pytest.raises(ValueError, match="drafter.serve_dtype=bfloat16 with model.dtype=float32"):
        load_config(DEMO, ["rollout.engine=vllm", "drafter.serve_dtype=bfloat16"])
    cfg = load_config(DEMO, ["rollout.engine=vllm", "drafter.serve_dtype=bfloat16", "model.dtype=bfloat16"])
    assert cfg.drafter.serve_dtype == "bfloat16"


class _Policy:
    def __init__(self, weights):
        self.weights = weights

    def canonical_weights(self, rollout_tp):
        return iter(self.weights.items())


class _Engine:
    def __init__(self):
        self.drafters = []

    def load_policy_weights(self, stream):
        list(stream)

    def load_drafter(self, drafter):
        self.drafters.append(drafter)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_the_served_copy_follows_the_fp32_masters(tmp_path, kind):
    target = tiny_target(seed=2)
    save_drafter(_drafter(kind, target.config), tmp_path / "d")
    view = TargetView(target.config).load(target.state_dict())
    fp32 = IdleDrafter(IdleDrafterConfig(), str(tmp_path / "d"), view, rank=0, seed=0)
    bf16 = IdleDrafter(IdleDrafterConfig(serve_dtype="bfloat16"), str(tmp_path / "d"), view, rank=0, seed=0)
    try:
        assert fp32.served() is fp32.drafter  # the default serves the trained module itself
        masters, served = bf16.drafter, bf16.served()
        assert all(p.dtype == torch.float32 for p in masters.parameters())  # the trainer's
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in served.parameters())
        assert _nbytes(served.parameters()) * 2 == _nbytes(masters.parameters())
        # the drafter's KV cache is in its dtype too: half the bytes per slot
        assert served.init_state(1, 1).cache.nbytes() * 2 == masters.init_state(1, 1).cache.nbytes()
        with torch.no_grad():  # a training round moves the masters
            for p in masters.parameters():
                p.add_(0.01)
        engine = _Engine()
        sync_weights(_Policy(target.state_dict()), engine, bf16, None, IdleResult(), tp=None, keep=False,
                     digest=False)
        assert engine.drafters == [served]  # the same copy, rewritten in place
        want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in masters.state_dict().items()}
        got = served.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        fp32.close()
        bf16.close()


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_a_bf16_served_drafter_keeps_sd_token_identical(kind, mode):
    target = tiny_target(seed=2)  # fp32 target arithmetic
    drafter = _drafter(kind, target.config).to(torch.bfloat16)
    sampling = SamplingParams(mode, max_new_tokens=40, seed=7)
    reqs = _requests()
    want = [r.tokens for r in TorchRolloutEngine(target).generate(reqs, sampling).results]
    out = TorchRolloutEngine(target, drafter).generate(reqs, sampling, policy=FixedSDPolicy(SHAPE))
    assert out.stats.sd_steps > 0 and max(out.stats.accept_lengths) > 1  # it drafted, and was accepted
    assert [r.tokens for r in out.results] == want


@pytest.mark.timeout(180)
def test_the_loop_serves_the_drafter_in_bf16_and_stays_lossless(tiny_models, tmp_path, monkeypatch):
    """Every hand-over of the drafter to the engine (at build, after each round) is the bf16 copy;
    TLT's rollouts and rewards equal the baseline's, the drafter trained on idle time."""
    from tiny_rl import tiny_overrides
    from nemo_tlt.train import main

    seen, load = tmp_path / "served", TorchRolloutEngine.load_drafter

    def recording(engine, drafter):  # the workers are forked: they write what they were handed
        if drafter is not None:
            with open(seen, "a") as f:
                f.write(f"{next(drafter.parameters()).dtype}\n")
        load(engine, drafter)
    monkeypatch.setattr(TorchRolloutEngine, "load_drafter", recording)
    target, drafter = tiny_models
    run = tmp_path / "run"
    assert main([str(DEMO), *tiny_overrides(target, drafter, run, steps=2), "drafter.serve_dtype=bfloat16",
                 "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["rollouts_identical"] and report["rewards_identical"]
    tlt = [json.loads(line) for line in (run / "pair1" / "tlt" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["sd_steps"] for r in tlt) > 0 and sum(r["drafter_steps"] for r in tlt if "drafter_steps" in r) > 0
    assert seen.read_text().split() == ["torch.bfloat16"] * 2 * 3  # 2 ranks: at build, after steps 0 and 1
