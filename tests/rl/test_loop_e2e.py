"""End to end: `nemo-tlt train ... --compare-baseline` (two pairs of runs, alternating
order) on a tiny SFT'd model with 2 worker processes, with GRPO in both update paths and
with DAPO and RLOO. TLT must train the drafter on idle workers and accept drafted tokens
with SD in the tail, and with coupled sampling every run must produce exactly the same
rollouts, rewards and policy weights; checkpoints, metrics, TensorBoard events and plots
are written."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_tlt.policy.batching import micro_batches
from nemo_tlt.train import main
from nemo_tlt.spot.checkpoint import CheckpointManager
from tiny_rl import tiny_overrides

pytestmark = pytest.mark.timeout(180)

def _final_policy(run: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(run / "checkpoints")
    try:
        ck = manager.load()
    finally:
        manager.close()
    return {k: v for k, v in ck.tensors.items() if k.startswith("policy/")}


def _rollout_span(timeline: list, rank: int) -> tuple[float, float]:
    """(start, end) of `rank`'s BUSY rollout time in one step's timeline events."""
    events = sorted((t, state) for k, state, t in timeline if k == rank)
    busy = next(t for t, state in events if state == "busy")
    return busy, next(t for t, state in events if state != "busy" and t >= busy)


RUNS = [(1, "tlt"), (1, "baseline"), (2, "baseline"), (2, "tlt")]  # two pairs, alternating order


@pytest.mark.parametrize("pipelined,algorithm", [(True, "grpo"), (False, "grpo"), (True, "dapo"), (False, "rloo")],
                         ids=["pipelined_update", "update_after_rollout", "dapo_pipelined", "rloo"])
def test_tlt_vs_baseline_two_workers(tiny_models, tmp_path, pipelined, algorithm):
    target, drafter = tiny_models
    run_dir = tmp_path / "run"
    yaml = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    overrides = [*tiny_overrides(target, drafter, run_dir), f"policy.pipelined_update={str(pipelined).lower()}",
                 f"algorithm={algorithm}"]
    assert main([str(yaml), *overrides, "--compare-baseline"]) == 0

    report = json.loads((run_dir / "report.json").read_text())
    assert report["rollouts_identical"] and report["rewards_identical"] and report["final_policy_identical"]
    assert [p["order"] for p in report["pairs"]] == [["tlt", "baseline"], ["baseline", "tlt"]]
    assert report["speedup"] > 0 and report["control_ratio"] > 0 and isinstance(report["noisy"], bool)
    assert [(r["pair"], r["mode"]) for r in report["runs"]] == RUNS
    assert all(len(r["step_times"]) == 3 for r in report["runs"])
    for name in ("reward_vs_step", "step_time_breakdown", "accept_length", "worker_timeline"):
        assert Path(report["plots"][name]).stat().st_size > 0
    assert (run_dir / "config.yaml").read_text().count("num_workers: 2") == 1

    runs = {(k, mode): [json.loads(line) for line in (run_dir / f"pair{k}" / mode / "metrics.jsonl")
                        .read_text().splitlines()] for k, mode in RUNS}
    tlts = [recs for (_, mode), recs in runs.items() if mode == "tlt"]
    bases = [recs for (_, mode), recs in runs.items() if mode == "baseline"]
    for recs in runs.values():
        assert [r["step"] for r in recs] == [0, 1, 2]
        for r in recs:
            assert all(math.isfinite(x) for x in r["rewards"]) and math.isfinite(r["loss"])
            assert r["replicas_identical"]  # both ranks hold the same policy (and drafter) bits
    # rewards vary inside groups, so the update is not vacuous
    assert any(r["reward_std"] > 0 for r in tlts[0])
    # the loss's token mean: every response token (GRPO, RLOO); DAPO drops the groups without
    # signal and the truncated rows, and did so at some step here
    counted = [(r["loss_tokens"], sum(r["resp_lens"])) for r in tlts[0]]
    if algorithm == "dapo":
        assert all(n <= total for n, total in counted) and any(n < total for n, total in counted), counted
    else:
        assert all(n == total for n, total in counted), counted
    for tlt in tlts:
        # TLT: the drafter trained on an idle worker, SD ran in the tail and accepted
        # drafted tokens (an accepted length of 1 is the target's own token alone)
        assert sum(r["drafter_samples"] for r in tlt) > 0 and sum(r["drafter_steps"] for r in tlt) > 0
        assert sum(r["sd_steps"] for r in tlt) > 0
        assert max(r["mean_accept_len"] for r in tlt if r["sd_steps"]) > 1
    for base in bases:  # the baseline did neither
        assert sum(r["sd_steps"] + r["drafter_samples"] for r in base) == 0
        assert sum(r["idle_s"] for r in base) > 0
    # decode segments: each rank's plain / SD stretches lie inside its BUSY rollout span
    for recs in runs.values():
        for r in recs:
            assert {seg[0] for seg in r["decode_segments"]} == {0, 1}
            for rank in (0, 1):
                busy, idle = _rollout_span(r["timeline"], rank)
                segs = [seg[1:] for seg in r["decode_segments"] if seg[0] == rank]
                assert all(busy - 1e-3 <= a <= b <= idle + 1e-3 for a, b, _ in segs), (busy, idle, segs, r["timeline"])
                assert 0 < sum(b - a for a, b, _ in segs) <= idle - busy + 1e-3
    assert all(seg[3] == "plain" for base in bases for r in base for seg in r["decode_segments"])
    assert any(seg[3] not in ("plain", "update") for tlt in tlts for r in tlt for seg in r["decode_segments"])
    # the pipelined update: TLT computed every group's gradient before the meet, one
    # "update" segment each (after the rank's own decoding, inside its BUSY span: above)
    for tlt in tlts:
        for r in tlt:
            early = [seg for seg in r["decode_segments"] if seg[3] == "update"]
            assert len(early) == (4 if pipelined else 0), early
    # coupled sampling: every run of every pair has the same tokens, rewards and policy weights
    first = runs[RUNS[0]]
    for recs in runs.values():
        assert [r["rollout_digest"] for r in recs] == [r["rollout_digest"] for r in first]
        assert [r["rewards"] for r in recs] == [r["rewards"] for r in first]
    weights = [_final_policy(run_dir / f"pair{k}" / mode) for k, mode in RUNS]
    for w in weights[1:]:
        assert w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w)
    initial = load_file(str(target / "model.safetensors"))
    assert any(not torch.equal(weights[0][f"policy/{k}"], v) for k, v in initial.items()), "policy never changed"
    # checkpoints (keep_last) and TensorBoard events
    for k, mode in RUNS:
        out = run_dir / f"pair{k}" / mode
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*"))[-1] == "step-00000002"
        assert list((out / "tb").glob("events.out.tfevents.*"))


def test_micro_batches_mask_response_targets():
    batch = [([1, 5, 6], [7, 8, 2]), ([1, 9], [4])]
    mbs = micro_batches(batch, size=8)
    assert len(mbs) == 1
    mb = mbs[0]
    # sorted by length: the short sequence first; targets are input_ids[:, 1:]
    assert mb.index.tolist() == [1, 0]
    assert mb.input_ids[0, :3].tolist() == [1, 9, 4] and mb.mask[0].tolist() == [0, 1, 0, 0, 0]
    assert mb.input_ids[1].tolist() == [1, 5, 6, 7, 8, 2] and mb.mask[1].tolist() == [0, 0, 1, 1, 1]
