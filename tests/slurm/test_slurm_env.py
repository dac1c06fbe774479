"""SLURM launch mode without a cluster: the environment read into a rank, the node list,
the port rule, the mode choice, and clear errors for a bad environment."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from nemo_tlt.dist import StopFlag
from nemo_tlt.dist.slurm import (PORT_ENV, SlurmEnvError, SlurmTask, expand_nodelist, in_srun_step,
                                 rendezvous_port, slurm_rendezvous)
from nemo_tlt.rl.workers import launch_mode, process_rank

TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "TLT_RDZV_HOST": "10.0.0.7"}


def workers(launcher: str, num_workers: int = 4) -> SimpleNamespace:
    return SimpleNamespace(launcher=launcher, num_workers=num_workers)


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu-a[01-02,10],login5", ["gpu-a01", "gpu-a02", "gpu-a10", "login5"]),
    ("r[1-2]-n[8-9]", ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[a-b]", "node[3-1]", ""])
def test_expand_nodelist_refuses_malformed(text):
    with pytest.raises(SlurmEnvError, match="node list"):
        expand_nodelist(text)


def test_rendezvous_from_slurm_variables():
    rdzv = slurm_rendezvous(4, TASK)
    assert (rdzv.rank, rdzv.world, rdzv.local_rank, rdzv.node) == (3, 4, 1, 1)
    assert rdzv.host == "10.0.0.7" and not rdzv.host_store
    assert rdzv.port == 15000 + 16 * (1234 % 900)
    assert slurm_rendezvous(4, {**TASK, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}).host_store


def test_rendezvous_host_is_the_first_node_without_scontrol(monkeypatch):
    monkeypatch.setattr("nemo_tlt.dist.slurm.shutil.which", lambda name: None)
    env = {k: v for k, v in TASK.items() if k != "TLT_RDZV_HOST"}
    assert slurm_rendezvous(4, env).host == "gpu07"
    # the step's own node list wins over the job's (a step on part of the allocation)
    assert slurm_rendezvous(4, {**env, "SLURM_STEP_NODELIST": "gpu08"}).host == "gpu08"


def test_port_rule():
    task = SlurmTask.from_env(TASK)
    base = rendezvous_port(task, TASK)
    assert rendezvous_port(task, TASK, launch_index=2) == base + 2  # k-th launch of the process
    other = SlurmTask.from_env({**TASK, "SLURM_JOB_ID": "1235"})
    assert rendezvous_port(other, TASK) == base + 16  # the next job on the node gets other ports
    assert rendezvous_port(task, {**TASK, PORT_ENV: "29500"}, 1) == 29501
    with pytest.raises(SlurmEnvError, match=PORT_ENV):
        rendezvous_port(task, {**TASK, PORT_ENV: "http"})


def test_missing_variables_are_named():
    env = {k: v for k, v in TASK.items() if k not in ("SLURM_PROCID", "SLURM_JOB_NODELIST")}
    with pytest.raises(SlurmEnvError, match=r"SLURM_PROCID, SLURM_JOB_NODELIST not set.*srun"):
        SlurmTask.from_env(env)
    with pytest.raises(SlurmEnvError, match=r"SLURM_NTASKS='four' is not an integer"):
        SlurmTask.from_env({**TASK, "SLURM_NTASKS": "four"})
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID=4 is outside SLURM_NTASKS=4"):
        SlurmTask.from_env({**TASK, "SLURM_PROCID": "4"})


def test_task_count_mismatch_names_both():
    with pytest.raises(SlurmEnvError, match=r"SLURM_NTASKS=4 tasks but workers.num_workers=2"):
        slurm_rendezvous(2, TASK)


def test_batch_shell_is_not_an_srun_task():
    batch = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}  # sbatch's shell has SLURM_PROCID=0
    assert in_srun_step(TASK) and not in_srun_step(batch)
    assert launch_mode(workers("auto"), batch) == "local"


def test_launch_mode():
    assert launch_mode(workers("auto"), {}) == "local"
    assert launch_mode(workers("auto"), TASK) == "slurm"
    assert launch_mode(workers("auto"), {**TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == "local"
    assert launch_mode(workers("slurm"), TASK) == "slurm"
    assert process_rank(workers("slurm"), TASK) == 3 and process_rank(workers("auto"), {}) == 0
    with pytest.raises(SlurmEnvError, match="workers.launcher=local, but this process is task 3 of SLURM_NTASKS=4"):
        launch_mode(workers("local"), TASK)
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID.*not set"):
        launch_mode(workers("slurm"), {})


def test_train_refuses_a_bad_slurm_environment(monkeypatch, tmp_path, capsys):
    from nemo_tlt.train import main

    for key in list(TASK):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    rc = main(["conf/demo.yaml", f"run_dir={tmp_path / 'run'}", "workers.launcher=slurm"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "SLURM_PROCID" in err and "srun" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_usr1_is_a_stop_request():
    flag = StopFlag().install()
    try:
        signal.raise_signal(signal.SIGUSR1)  # SLURM's warning, forwarded by the sbatch scripts
        assert flag.requested and flag.signum == signal.SIGUSR1
    finally:
        flag.restore()
