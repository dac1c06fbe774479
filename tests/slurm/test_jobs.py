"""The sbatch scripts on a real SLURM cluster (tests/slurm/conftest.py) with a tiny config:
the demo job completes and writes its report; a run on 2 nodes x 1 task (SLURM launch
mode) equals the same run launched by the local spawn launcher, bit for bit; USR1 sent
to the batch shell stops the run at a step boundary with a checkpoint, and a requeue
resumes it to the end."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_tlt.spot.checkpoint import CheckpointManager
from nemo_tlt.train import main
from rl.test_loop_e2e import tiny_assets, tiny_overrides

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "conf" / "demo.yaml"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return tiny_assets(tmp_path_factory.getbasetemp() / "tlt_tiny_assets")


@pytest.fixture
def cluster(slurm_cluster):
    slurm_cluster.env["TLT_PYTHON"] = sys.executable  # the jobs run this checkout with this python
    slurm_cluster.env["OMP_NUM_THREADS"] = "1"
    return slurm_cluster


def submit(cluster, script: str, out: Path, *args: str, options: tuple[str, ...] = ()) -> int:
    return cluster.sbatch(REPO / "slurm" / script, *args, options=[f"--output={out}", *options], cwd=REPO)


def finished(cluster, job: int, out: Path, timeout_s: float = 240.0, want: str = "COMPLETED") -> str:
    state = cluster.wait(job, timeout_s)
    log = out.read_text(errors="replace") if out.is_file() else "(no job output)"
    assert state == want, f"job {job} ended {state}, wanted {want}; its output:\n{log[-4000:]}"
    return log


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_policy(run: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(run / "checkpoints")
    try:
        ck = manager.load()
    finally:
        manager.close()
    return {k: v for k, v in ck.tensors.items() if k.startswith("policy/")}


def test_demo_job_writes_its_report(cluster, tiny_models, tmp_path):
    run = tmp_path / "demo"
    args = tiny_overrides(*tiny_models, run, steps=1)
    job = submit(cluster, "tlt_demo.sbatch", tmp_path / "demo.out", str(DEMO), *args, "--compare-baseline",
                 "--pairs", "1")
    log = finished(cluster, job, tmp_path / "demo.out")
    report = json.loads((run / "report.json").read_text())
    # two launches in one srun step (TLT then baseline): the second rendezvous works too
    assert [(r["pair"], r["mode"]) for r in report["runs"]] == [(1, "tlt"), (1, "baseline")]
    assert report["rollouts_identical"] and report["rewards_identical"]
    assert log.count("run folder:") == 1  # rank 0 alone reports
    assert "launcher: slurm" in (run / "config.yaml").read_text()


def test_two_nodes_equal_the_spawn_launcher(cluster, tiny_models, tmp_path):
    slurm_run, local_run = tmp_path / "slurm", tmp_path / "local"
    job = submit(cluster, "tlt_multinode.sbatch", tmp_path / "multi.out", str(DEMO),
                 *tiny_overrides(*tiny_models, slurm_run, steps=2), options=("--nodes=2", "--ntasks-per-node=1"))
    assert main([str(DEMO), *tiny_overrides(*tiny_models, local_run, steps=2), "workers.launcher=local",
                 "workers.start_method=spawn"]) == 0
    finished(cluster, job, tmp_path / "multi.out")
    info = cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
    assert re.search(r"NumNodes=2 ", info) and re.search(r"NumTasks=2 ", info), info
    a, b = metrics(slurm_run / "tlt"), metrics(local_run / "tlt")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1]
    assert [r["rollout_digest"] for r in a] == [r["rollout_digest"] for r in b]
    assert [r["rewards"] for r in a] == [r["rewards"] for r in b]
    pa, pb = final_policy(slurm_run / "tlt"), final_policy(local_run / "tlt")
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_usr1_stops_with_a_checkpoint_and_a_requeue_resumes(cluster, tiny_models, tmp_path):
    run, out, steps = tmp_path / "pre", tmp_path / "pre.out", 40
    job = submit(cluster, "tlt_demo.sbatch", out, str(DEMO), *tiny_overrides(*tiny_models, run, steps=steps),
                 "drafter.train_on_idle=false")
    deadline = time.monotonic() + 180
    while not ((run / "tlt" / "metrics.jsonl").is_file() and metrics(run / "tlt")):
        assert time.monotonic() < deadline and cluster.state(job) in ("PENDING", "RUNNING"), cluster.state(job)
        time.sleep(0.2)
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])  # what --signal=B:USR1@N does
    log = finished(cluster, job, out, want="FAILED")  # exit 130: interrupted and checkpointed
    assert "forwarding it to the workers" in log and "stopped on USR1 and checkpointed" in log
    done = metrics(run / "tlt")
    assert 1 <= len(done) < steps
    assert json.loads((run / "report.json").read_text())["tlt"]["status"] == "interrupted"

    cluster.requeue(job)
    log = finished(cluster, job, out)
    assert "continuing with resume=true" in log
    assert "resume: true" in (run / "config.yaml").read_text()  # the requeued job ran with resume=true
    assert [r["step"] for r in metrics(run / "tlt")] == list(range(steps))
