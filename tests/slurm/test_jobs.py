"""The sbatch scripts on a real SLURM cluster (tests/slurm/conftest.py) with a tiny config:
the demo job completes and writes its report; on 2 nodes x 2 tasks the drafter is averaged
through the node leaders, with the same rollouts and rewards as 4 local workers; on 2 nodes
x 1 task (SLURM launch mode), USR1 sent to the batch shell stops the run at a step boundary
with a checkpoint, and a requeue by the script itself resumes it to the end, equal bit for
bit to the same run uninterrupted by the local spawn launcher (so an uninterrupted 2 x 1
job, a strict part of it, has no test of its own); a job that cannot be requeued says so;
a 1-minute job stops before its time limit with a whole checkpoint."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_tlt.spot.checkpoint import CheckpointManager
from nemo_tlt.train import main
from rl.test_loop_e2e import _final_policy as final_policy
from tiny_rl import tiny_overrides

from .cluster import FINAL_STATES
from .compare import assert_same_runs, metrics

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "conf" / "demo.yaml"


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
    info = ""
    if state != want:
        info = cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
        info += "\nslurmctld log:\n" + "\n".join(line for line in cluster.log("slurmctld").splitlines()
                                                 if f"JobId={job}" in line or f"job {job}" in line.lower())[-3000:]
        for node in ("node1", "node2"):
            info += f"\nslurmd log ({node}):\n" + cluster.log(f"slurmd.{node}")[-1500:]
    assert state == want, f"job {job} ended {state}, wanted {want}; {info}\nits output:\n{log[-4000:]}"
    return log


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


def slurm_and_spawn(cluster, tiny_models, tmp_path, nodes: int, tasks_per_node: int, timeout_s: float = 240.0,
                    start_method: str = "spawn"):
    """The tiny config (coupled sampling, 2 steps) as a SLURM job of `nodes` x `tasks_per_node`
    tasks and, meanwhile, as as many local workers (spawned unless `start_method` says
    otherwise). Both must end, with the same rollouts, rewards and final policy, bit for bit.
    Returns (slurm run, local run, their records)."""
    slurm_run, local_run, workers = tmp_path / "slurm", tmp_path / "local", nodes * tasks_per_node
    job = submit(cluster, "tlt_multinode.sbatch", tmp_path / "multi.out", str(DEMO),
                 *tiny_overrides(*tiny_models, slurm_run, steps=2, workers=workers),
                 options=(f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"))
    assert main([str(DEMO), *tiny_overrides(*tiny_models, local_run, steps=2, workers=workers),
                 "workers.launcher=local", f"workers.start_method={start_method}"]) == 0
    finished(cluster, job, tmp_path / "multi.out", timeout_s=timeout_s)
    info = cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
    assert re.search(rf"NumNodes={nodes} ", info) and re.search(rf"NumTasks={workers} ", info), info
    a, b = assert_same_runs(slurm_run / "tlt", local_run / "tlt", steps=2)
    assert "launcher: slurm" in (slurm_run / "config.yaml").read_text()
    return slurm_run, local_run, a, b


def drafter(run: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(run / "checkpoints")
    try:
        return {k: v for k, v in manager.load().tensors.items() if k.startswith("drafter/")}
    finally:
        manager.close()


@pytest.mark.timeout(300)
def test_two_nodes_of_two_average_the_drafter_through_node_leaders(cluster, tiny_models, tmp_path):
    # 4 ranks as 2 nodes x 2 tasks: the drafter average reduces inside each node, then
    # among the 2 leaders; rollouts never depend on the drafter (coupled sampling is
    # lossless), so they equal a 4-worker local run's (one node, flat average). Its workers are
    # forked (the tests' default, tiny_overrides): 4 spawned ones would import torch again, about
    # 6 s of this 2-core machine beside the job's 4 tasks; the spawn launcher's equality with a
    # SLURM job is the USR1 test's.
    slurm_run, local_run, a, b = slurm_and_spawn(cluster, tiny_models, tmp_path, nodes=2, tasks_per_node=2,
                                                 timeout_s=500, start_method="fork")
    for r in a:
        assert r["rank_nodes"] == [0, 0, 1, 1]
        assert set(r["drafter_samples_per_node"]) == {"0", "1"}
        assert sum(r["drafter_samples_per_node"].values()) == r["drafter_samples"]
        assert r["drafter_sync_hierarchical"] and r["replicas_identical"]  # same drafter bits on both nodes
    for r in b:
        assert r["rank_nodes"] == [0, 0, 0, 0] and r["drafter_samples_per_node"].keys() == {"0"}
        assert not r["drafter_sync_hierarchical"] and r["replicas_identical"]
    assert sum(r["drafter_samples"] for r in a) > 0  # the drafter trained, so the average moved weights
    # How much each rank trains depends on when the last rollout ends (wall clock), so the
    # two runs' drafters differ beyond rounding; both must still be whole and finite.
    da, db = drafter(slurm_run / "tlt"), drafter(local_run / "tlt")
    assert da.keys() == db.keys() and da
    assert all(torch.isfinite(v).all() for v in da.values())


def wait_for(what: str, ready, timeout_s: float = 180.0, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def old_run_gone(cluster, job: int, nodes: tuple[str, ...] = ("node1", "node2")) -> bool:
    """The requeued job's first run has ended on every node it ran on: each slurmd logged
    its step 0, and the batch host its batch step, as done. (slurmctld's node states turn
    idle at the requeue, before the slurmds have finished; a start then finds the job's
    credential revoked and fails.)"""
    logs = {node: cluster.log(f"slurmd.{node}", tail=None) for node in nodes}
    return (f"[{job}.batch] done with job" in logs[nodes[0]]
            and all(f"[{job}.0] done with job" in text for text in logs.values()))


def job_field(cluster, job: int, field: str) -> str:
    info = cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
    m = re.search(rf"\b{field}=(\S+)", info)
    assert m, f"no {field} in: {info}"
    return m.group(1)


def requeued(cluster, job: int, out: Path) -> bool:
    """The job is back in the queue after its first run (AssertionError if it ended instead)."""
    state = cluster.state(job)
    assert state not in FINAL_STATES, f"job {job} ended {state} instead of requeueing:\n{out.read_text()[-3000:]}"
    return state == "PENDING" and job_field(cluster, job, "Restarts") == "1"


def test_usr1_checkpoints_requeues_itself_and_resumes_like_an_uninterrupted_run(cluster, tiny_models, tmp_path):
    # 2 nodes x 1 task: the resumed run must also find its rendezvous and nodes again
    run, out, steps = tmp_path / "pre", tmp_path / "pre.out", 8
    args = tiny_overrides(*tiny_models, run, steps=steps)
    job = submit(cluster, "tlt_multinode.sbatch", out, str(DEMO), *args, options=("--nodes=2", "--ntasks-per-node=1"))
    wait_for("the first step record",
             lambda: (run / "tlt" / "metrics.jsonl").is_file() and metrics(run / "tlt")
             or cluster.state(job) not in ("PENDING", "RUNNING"))
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])  # what --signal=B:USR1@N does
    # the script requeues the job itself; SLURM holds a requeued job back ~2 min: start it now
    wait_for("the requeue", lambda: requeued(cluster, job, out))
    stopped = metrics(run / "tlt")
    assert 1 <= len(stopped) < steps
    assert json.loads((run / "report.json").read_text())["tlt"]["status"] == "interrupted"
    # SLURM holds a requeued job back ~2 min, long after its old allocation is cleaned
    # up; starting it at once must still wait for that cleanup, or the old batch
    # shell's end can be booked against the new run.
    wait_for("the old run's end on both nodes", lambda: old_run_gone(cluster, job))
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    local = tmp_path / "local"  # the same run, uninterrupted, by the spawn launcher (meanwhile)
    assert main([str(DEMO), *tiny_overrides(*tiny_models, local, steps=steps), "workers.launcher=local",
                 "workers.start_method=spawn"]) == 0
    log = finished(cluster, job, out)
    assert "forwarding it to the workers" in log and "stopped on USR1 and checkpointed" in log
    assert f"requeued job {job}" in log and "continuing with resume=true" in log
    assert "resume: true" in (run / "config.yaml").read_text()  # the requeued job ran with resume=true
    a, b = metrics(run / "tlt"), metrics(local / "tlt")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(steps))
    assert a[:len(stopped)] == stopped  # the resumed run kept the steps done before the stop
    assert [r["rollout_digest"] for r in a] == [r["rollout_digest"] for r in b]
    assert [r["rewards"] for r in a] == [r["rewards"] for r in b]
    assert all(r["rank_nodes"] == [0, 1] for r in a)
    pa, pb = final_policy(run / "tlt"), final_policy(local / "tlt")
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    save_records(a, "usr1_requeued")


def test_usr1_without_requeue_says_so_and_keeps_the_checkpoint(cluster, tiny_models, tmp_path):
    run, out = tmp_path / "noq", tmp_path / "noq.out"
    job = submit(cluster, "tlt_demo.sbatch", out, str(DEMO), *tiny_overrides(*tiny_models, run, steps=40),
                 "drafter.train_on_idle=false", options=("--no-requeue",))
    wait_for("the first step record",
             lambda: (run / "tlt" / "metrics.jsonl").is_file() and metrics(run / "tlt")
             or cluster.state(job) not in ("PENDING", "RUNNING"))
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    log = finished(cluster, job, out, want="FAILED")
    assert job_field(cluster, job, "ExitCode") == "130:0" and job_field(cluster, job, "Restarts") == "0"
    assert f"job {job} cannot be requeued" in log and "resubmit it with resume=true" in log
    assert CheckpointManager(run / "tlt" / "checkpoints").latest() == metrics(run / "tlt")[-1]["step"]


def test_a_one_minute_job_stops_before_its_limit_with_a_checkpoint(cluster, tiny_models, tmp_path):
    # SLURM 22.05 exports no end time: the time keeper asks squeue once. Stop when less
    # than the margin (40 s) plus the next step is left: about 20 s into the job. The
    # script's USR1 warning is replaced by a harmless SIGCONT, so the time keeper alone acts.
    # SLURM itself says the limit was not reached: the job ends FAILED with exit 130 (a job
    # killed at its limit ends TIMEOUT).
    run, out, steps = tmp_path / "limit", tmp_path / "limit.out", 5000  # ~0.2 s a step: far more than fit
    job = submit(cluster, "tlt_demo.sbatch", out, str(DEMO), *tiny_overrides(*tiny_models, run, steps=steps),
                 "workers.time_limit_margin_s=40", options=("--time=1", "--signal=B:CONT@1", "--no-requeue"))
    log = finished(cluster, job, out, timeout_s=200, want="FAILED")  # exit 130: stopped, not TIMEOUT
    assert job_field(cluster, job, "ExitCode") == "130:0"
    assert "stopped before the job's time limit" in log and "continue with resume=true" in log
    assert "USR1" not in log
    done = metrics(run / "tlt")
    assert 1 <= len(done) < steps
    assert all(r["time_left_s"] is not None and r["time_left_s"] > 0 for r in done)
    assert json.loads((run / "report.json").read_text())["tlt"]["status"] == "time_limit"
    manager = CheckpointManager(run / "tlt" / "checkpoints")
    try:
        assert manager.latest() == done[-1]["step"]
        assert manager.load().tensors  # the last checkpoint is whole
    finally:
        manager.close()


def save_records(records: list[dict], name: str) -> None:
    """Keep a run's records for the docs' pictures (TLT_KEEP_RECORDS=<folder>)."""
    folder = os.environ.get("TLT_KEEP_RECORDS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
