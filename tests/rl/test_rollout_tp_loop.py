"""The RL loop with rollout TP 2 (``rollout.tensor_parallel=2``: both workers form one rollout
replica whose embedded engine is split over them): TLT and baseline stay identical (rewards,
rollouts, final policy weights), every rank of the replica holds half of the split weights,
and the run equals a rollout-TP-1 run on its first rollout and, to float tolerance, on the
policy its first update makes (the replica's groups are split between the two policy
replicas as rollout TP 1 splits the prompts)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_tlt.train import main

from tiny_rl import tiny_overrides
from .test_megatron_loop import _policy_at

pytestmark = pytest.mark.timeout(180)
DEMO = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
NOT_PIPELINED = ["policy.pipelined_update=false", "policy.micro_batch_tokens=0"]


def _metrics(run: Path, split: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == split]


def test_rollout_tp2_is_lossless_and_matches_tp1(tiny_models, tmp_path):
    target, drafter = tiny_models
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    assert main([str(DEMO), *tiny_overrides(target, drafter, tp2, steps=2), *NOT_PIPELINED,
                 "rollout.tensor_parallel=2", "validation.every=2", "validation.num_prompts=5",
                 "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((tp2 / "report.json").read_text())
    # validation decodes each prompt once (in the replica, every member together), counted once
    assert [r["num_prompts"] for r in _metrics(tp2 / "pair1" / "tlt", "validation")] == [5]
    assert report["rollouts_identical"] and report["rewards_identical"] and report["final_policy_identical"]
    tlt = _metrics(tp2 / "pair1" / "tlt")
    assert all(r["replicas_identical"] for r in tlt)
    assert sum(r["sd_steps"] for r in tlt) > 0, "TLT never speculated at rollout TP 2"
    assert all(len(r["rewards"]) == 16 and min(r["resp_lens"]) > 0 for r in tlt)  # every sequence counted once
    # the replica's decode steps are counted once (its leader's): one plain step per token of the longest row
    base = _metrics(tp2 / "pair1" / "baseline")
    assert all(0 < r["plain_steps"] <= r["resp_len_max"] and r["sd_steps"] == 0 for r in base)
    assert main([str(DEMO), *tiny_overrides(target, drafter, tp1, steps=1), *NOT_PIPELINED]) == 0
    one = _metrics(tp1 / "tlt")
    assert tlt[0]["rollout_digest"] == one[0]["rollout_digest"]
    assert tlt[0]["rewards"] == one[0]["rewards"]
    # the same update: each policy replica took its half of the replica's groups, tokens counted once
    for key in ("loss", "grad_norm"):
        assert tlt[0][key] == pytest.approx(one[0][key], rel=1e-5, abs=1e-7), key
    w2, w1 = _policy_at(tp2 / "pair1" / "tlt", 0), _policy_at(tp1 / "tlt", 0)
    assert w2.keys() == w1.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=1e-5)


def test_pipelined_update_at_rollout_tp2_is_the_rollout_tp1_update_bit_for_bit(tiny_models, tmp_path):
    """The pipelined update with a replica of 2 ranks: the leader publishes each group once,
    both ranks claim pieces (TLT) or split the replica's groups (baseline), tokens counted once;
    summed in fixed point, the update equals the rollout-TP-1 run's exactly."""
    target, drafter = tiny_models
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    assert main([str(DEMO), *tiny_overrides(target, drafter, tp2, steps=2), "rollout.tensor_parallel=2",
                 "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((tp2 / "report.json").read_text())
    assert report["rollouts_identical"] and report["rewards_identical"] and report["final_policy_identical"]
    tlt = _metrics(tp2 / "pair1" / "tlt")
    assert all(r["replicas_identical"] for r in tlt) and sum(r["sd_steps"] for r in tlt) > 0
    assert all(len(r["rewards"]) == 16 for r in tlt)
    assert main([str(DEMO), *tiny_overrides(target, drafter, tp1, steps=1)]) == 0
    one = _metrics(tp1 / "tlt")
    assert tlt[0]["rollout_digest"] == one[0]["rollout_digest"]
    assert (tlt[0]["loss"], tlt[0]["grad_norm"]) == (one[0]["loss"], one[0]["grad_norm"])
    w2, w1 = _policy_at(tp2 / "pair1" / "tlt", 0), _policy_at(tp1 / "tlt", 0)
    assert w2.keys() == w1.keys() and all(torch.equal(w2[k], w1[k]) for k in w1)


def test_rollout_tp2_with_megatron_policy_tp2(tiny_models, tmp_path):
    pytest.importorskip("megatron.core")
    target, drafter = tiny_models
    run = tmp_path / "mc"
    # checkpoint.every=2: no checkpoint but the last (nothing here reads one; a sharded save costs
    # ~2 s, twice per run). A save in flight during the next rollout at policy TP 2 x rollout TP 2
    # is tested by tests/rl/test_resume.py[megatron_tp2_rollout_tp2] (its cut and resumed runs).
    assert main([str(DEMO), *tiny_overrides(target, drafter, run, steps=2), *NOT_PIPELINED,
                 "policy.backend=megatron", "policy.tensor_parallel=2", "rollout.tensor_parallel=2",
                 "checkpoint.every=2", "--compare-baseline", "--pairs", "1"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["rollouts_identical"] and report["rewards_identical"] and report["final_policy_identical"]
    tlt = _metrics(run / "pair1" / "tlt")
    assert all(r["replicas_identical"] for r in tlt) and sum(r["sd_steps"] for r in tlt) > 0
