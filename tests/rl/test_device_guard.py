"""One RL step on every rank with torch's default device set to ``meta``: any tensor the
loop, the rollout engine (plain and SD), the drafter harvest and training, or the policy
backend creates without the rank's configured device lands on ``meta`` and fails where it
meets a real tensor. This is what a GPU run would catch as a device mismatch. Run in
fp32 and in bf16 (``model.dtype``), so one bf16 RL step runs in CI too. A tensor made with an
explicit ``device="cpu"`` passes here (the configured device is the CPU): tests/test_device_lint.py
catches those in the source."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_tlt.config import load_config
from nemo_tlt.rl.loop import RLWorker
from nemo_tlt.rl.run import RunSpec, prepare_run_dir
from nemo_tlt.rl.workers import launch

from tiny_rl import tiny_overrides

pytestmark = pytest.mark.timeout(180)
DEMO = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"


def steps_on_meta(spec, comm, stop, on_step):
    """Build the rank on the CPU, then run two RL steps with `meta` as the default device."""
    worker = RLWorker(spec, comm, stop)
    worker.t0 = worker.coord.now()
    try:
        with torch.device("meta"):
            records = [worker.step(step) for step in range(2)]
        params = list(worker.policy.model.parameters())
        return comm.gather({"records": records, "param_devices": sorted({str(p.device) for p in params}),
                            "param_dtypes": sorted({str(p.dtype) for p in params})})
    finally:
        if worker.drafter is not None:
            worker.drafter.close()
        worker.saver.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rl_steps_create_nothing_off_the_configured_device(tiny_models, tmp_path, dtype):
    target, drafter = tiny_models
    cfg = load_config(DEMO, tiny_overrides(target, drafter, tmp_path, steps=2)
                      + [f"model.dtype={dtype}", "workers.device=cpu", "rollout.sd_policy=threshold"])
    spec = RunSpec(cfg, "tlt", str(tmp_path / "tlt"), str(target), str(drafter))
    prepare_run_dir(spec)
    ranks = launch(spec, steps_on_meta)
    for rank in ranks:
        assert rank["param_devices"] == ["cpu"] and rank["param_dtypes"] == [f"torch.{dtype}"]
    record = ranks[0]["records"][-1]
    assert record["sd_steps"] > 0  # speculation ran under the guard
    assert all(r == r for r in record["rewards"])  # finite rewards came back
    # the engine's generation log-probs against the update forward's (default: no separate pass)
    gap = record["logprob_gap"]
    assert gap is not None and gap < (1e-4 if dtype == "float32" else 0.05), gap
