"""torchrun launch mode: chosen from torchrun's variables (before SLURM's), missing ones
and a world other than workers.num_workers are refused by name; only RANK 0 reports; and
a real `torchrun --standalone --nproc-per-node 2` train with --compare-baseline (two
launches in one process, each rendezvousing again in torchrun's store) equals the local
spawn launch bit for bit, with one "run folder:" line and `launcher: torchrun` recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import datetime

import pytest
import torch.distributed as dist

from nemo_tlt.dist.torchrun import TorchrunEnvError, TorchrunTask, launch_torchrun, torchrun_rendezvous
from nemo_tlt.rl.workers import launch_mode, process_rank
from nemo_tlt.train import main
from tiny_rl import tiny_overrides
from slurm.compare import assert_same_runs

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "conf" / "demo.yaml"
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}


def workers(launcher: str = "auto", num_workers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(launcher=launcher, num_workers=num_workers, device="cpu")


def test_auto_picks_torchrun_before_slurm_and_only_rank_0_reports():
    assert launch_mode(workers(), {**SRUN, **TORCHRUN}) == "torchrun"
    assert launch_mode(workers(), SRUN) == "slurm"
    assert launch_mode(workers(), {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}) == "local"
    assert process_rank(workers(), TORCHRUN) == 1
    assert process_rank(workers(), {**TORCHRUN, "RANK": "0"}) == 0


def test_missing_variables_are_named():
    with pytest.raises(TorchrunEnvError, match="LOCAL_RANK, MASTER_PORT not set"):
        launch_mode(workers("torchrun"), {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_a_world_other_than_num_workers_is_refused_naming_both():
    with pytest.raises(TorchrunEnvError, match="WORLD_SIZE=2 .*workers.num_workers=3"):
        torchrun_rendezvous(3, TORCHRUN)


def test_local_under_a_torchrun_world_is_refused():
    with pytest.raises(TorchrunEnvError, match="workers.launcher=local"):
        launch_mode(workers("local"), TORCHRUN)
    assert launch_mode(workers("local"), {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == "local"


def test_the_agent_hosts_the_store_else_rank_0_and_each_launch_has_its_own_keys():
    rdzv, prefix = torchrun_rendezvous(2, {**TORCHRUN, "RANK": "0"}, launch_index=3)
    assert (rdzv.host, rdzv.port, rdzv.rank, rdzv.local_rank, rdzv.host_store) == ("127.0.0.1", 29500, 0, 1, False)
    assert prefix == "tlt/launch3/"
    env = {k: v for k, v in TORCHRUN.items() if k not in ("TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK")}
    rdzv, _ = torchrun_rendezvous(2, {**env, "RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert rdzv.host_store and rdzv.node == 0
    assert TorchrunTask.from_env({**env, "LOCAL_WORLD_SIZE": "1"}).node == 1


def _set_key(ctx):
    ctx.store.set("coordinator/state", "left by the first launch")
    return ctx.store.num_keys()


def _sees_key(ctx):
    return ctx.store.check(["coordinator/state"])


@pytest.mark.timeout(60)
def test_each_launch_rendezvouses_again_in_the_agents_store_under_its_own_keys():
    """torchrun's agent store (stood in for by a TCPStore on an OS-picked port) outlives
    every launch of the process: a second launch joins again and does not see the keys of
    the first."""
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": str(agent.port)}
    assert launch_torchrun(_set_key, 1, env=env) >= 1
    assert not dist.is_initialized()
    assert launch_torchrun(_sees_key, 1, env=env) is False
    assert agent.check(["coordinator/state"]) is False  # nothing unprefixed in the agent's store


@pytest.mark.timeout(180)
def test_torchrun_equals_the_spawn_launcher(tiny_models, tmp_path):
    """torchrun --standalone binds its rendezvous to port 0 (the OS picks a free one), so
    concurrent tests cannot collide."""
    tr_run, local_run = tmp_path / "torchrun", tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "nemo_tlt.cli", "train", str(DEMO), *tiny_overrides(*tiny_models, tr_run, steps=2, workers=2),
         "--compare-baseline", "--pairs", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert log.count("run folder:") == 1, log[-6000:]  # rank 0 alone reports
    config = (tr_run / "config.yaml").read_text()
    assert "launcher: torchrun" in config and "device: cpu" in config
    report = json.loads((tr_run / "report.json").read_text())
    # two launches in one torchrun worker (TLT then baseline): the second rendezvous works too
    assert [(r["pair"], r["mode"]) for r in report["runs"]] == [(1, "tlt"), (1, "baseline")]
    assert report["rollouts_identical"] and report["rewards_identical"]
    assert main([str(DEMO), *tiny_overrides(*tiny_models, local_run, steps=2, workers=2),
                 "workers.launcher=local", "workers.start_method=spawn"]) == 0
    assert "launcher: local" in (local_run / "config.yaml").read_text()
    assert_same_runs(tr_run / "pair1" / "tlt", local_run / "tlt", steps=2)
