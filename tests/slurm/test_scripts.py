"""The sbatch scripts of slurm/: every one asks for preemption warning and requeue; the
H100 scripts name configs that validate and whose worker count is the scripts' task
count, and SLURM accepts them (``sbatch --test-only``) on a cluster of 8-GPU nodes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.dist.slurm import expand_nodelist

# the first test that asks for the cluster may install SLURM with apt-get and start it
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
H100 = {"qwen2.5-32b_grpo.sbatch": 4, "llama3.3-70b_grpo.sbatch": 8}  # nodes of 8 H100


def sbatch_options(script: Path) -> dict[str, str]:
    opts = {}
    for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script.read_text(), re.M):
        opts[m.group(1)] = m.group(2) or ""
    return opts


def test_every_script_is_there_and_asks_for_warning_and_requeue():
    assert {p.name for p in SCRIPTS} >= {"tlt_demo.sbatch", "tlt_multinode.sbatch", *H100}
    for script in SCRIPTS:
        opts = sbatch_options(script)
        assert re.fullmatch(r"B:USR1@\d+", opts.get("signal", "")), script.name
        assert "requeue" in opts, script.name
        assert "source slurm/tlt_job.sh" in script.read_text() and "tlt_train" in script.read_text(), script.name


@pytest.mark.parametrize("name", sorted(H100))
def test_h100_script_config_validates_and_matches_its_tasks(name):
    script = REPO / "slurm" / name
    opts = sbatch_options(script)
    config = re.search(r"tlt_train -- (conf/\S+\.yaml)", script.read_text()).group(1)
    cfg = load_config(str(REPO / config), [])
    assert int(opts["nodes"]) == H100[name] and opts["gpus-per-node"] == "8"
    assert int(opts["nodes"]) * int(opts["ntasks-per-node"]) == cfg.workers.num_workers
    assert cfg.policy.backend == "megatron"
    # one GPU per task by local rank, every GPU of the node visible (NCCL peer-to-peer), bf16
    assert (cfg.workers.device, cfg.model.dtype) == ("cuda", "bfloat16")
    text = script.read_text() + (REPO / "slurm" / "tlt_job.sh").read_text()
    assert not re.search(r"^[^#]*(--gpus-per-task|--gpu-bind|CUDA_VISIBLE_DEVICES=)", text, re.M)
    assert "tlt_network_env" in script.read_text()


@pytest.mark.parametrize("name", sorted(H100))
def test_h100_script_passes_sbatch_test_only(slurm_cluster, name):
    out = slurm_cluster.run(["sbatch", "--test-only", str(REPO / "slurm" / name)], check=False, cwd=REPO)
    assert out.returncode == 0, out.stderr
    nodes = H100[name]
    assert re.search(rf"using \d+ processors on nodes node\[1-{nodes}\]", out.stderr), out.stderr


def test_test_only_refuses_what_the_cluster_lacks(slurm_cluster):
    """The check above can fail: 9 GPUs per node do not exist on this cluster."""
    out = slurm_cluster.run(["sbatch", "--test-only", "--gpus-per-node=9", str(REPO / "slurm" / "qwen2.5-32b_grpo.sbatch")],
                            check=False, cwd=REPO)
    assert out.returncode != 0


@pytest.mark.parametrize("text", ["node[1-3,5]", "node1,node[7-8]", "node[2-3],node5"])
def test_nodelist_expansion_agrees_with_scontrol(slurm_cluster, text):
    out = slurm_cluster.run(["scontrol", "show", "hostnames", text])
    assert expand_nodelist(text) == out.stdout.split()
