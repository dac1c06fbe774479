"""The launcher's GPU choices on a simulated CUDA host (4 GPUs; torch.cuda and
init_process_group replaced by recorders, so this runs on CPU): local rank r binds
cuda:r and makes it current before it joins; the group carries NCCL for CUDA and gloo
for CPU; device=cpu on a CUDA host stays gloo/CPU; workers.device=cuda without CUDA, or a
local rank past the GPU count, fails before any work, naming workers.device."""
from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.config import WorkersConfig
from nemo_tlt.dist import Rendezvous, launch_local
from nemo_tlt.dist.launch import run_rank
from nemo_tlt.rl.workers import launch, resolved_workers
from nemo_tlt.train import main

GPUS = 4


@pytest.fixture
def host(monkeypatch):
    """A host with GPUS GPUs; `host.calls` records set_device and init_process_group in order."""
    calls: list[tuple] = []
    state = SimpleNamespace(calls=calls, cuda=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state.cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: GPUS if state.cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))

    def init_process_group(backend, **kwargs):
        calls.append(("init_process_group", backend, kwargs.get("device_id")))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    return state


def _rank(kind: str, local_rank: int) -> torch.device:
    rdzv = Rendezvous("127.0.0.1", 0, rank=local_rank, world=GPUS, local_rank=local_rank)
    return run_rank(lambda ctx: ctx.device, rdzv, (), timeout_s=5, threads=1, device=kind, store=dist.HashStore())


@pytest.mark.parametrize("kind", ["cuda", "auto"])
def test_local_rank_3_binds_cuda_3_before_it_joins_nccl_for_tensors_gloo_for_objects(host, kind):
    assert _rank(kind, 3) == torch.device("cuda", 3)
    assert host.calls == [("set_device", torch.device("cuda", 3)),
                          ("init_process_group", "cpu:gloo,cuda:nccl", torch.device("cuda", 3))]


def test_cpu_on_a_cuda_host_stays_gloo_on_the_cpu(host):
    assert _rank("cpu", 3) == torch.device("cpu")
    assert host.calls == [("init_process_group", "gloo", None)]


def test_auto_without_cuda_is_gloo_on_the_cpu(host):
    host.cuda = False
    assert _rank("auto", 0) == torch.device("cpu")
    assert host.calls == [("init_process_group", "gloo", None)]


def test_a_local_rank_past_the_gpu_count_is_refused_before_joining(host):
    with pytest.raises(ValueError, match="workers.device=cuda: local rank 4 has no GPU"):
        _rank("cuda", 4)
    assert host.calls == []


def _never(ctx):
    raise AssertionError("no rank may start")


def test_a_local_launch_is_checked_before_any_rank_starts(host):
    with pytest.raises(ValueError, match="local rank 4 has no GPU"):
        launch_local(_never, GPUS + 1, device="cuda", hide_cuda=False)
    host.cuda = False
    with pytest.raises(ValueError, match="workers.device=cuda, but CUDA is not available"):
        launch_local(_never, 2, device="cuda", hide_cuda=False)
    assert not multiprocessing.active_children() and host.calls == []


def test_hidden_cuda_forces_the_cpu(host):
    with pytest.raises(ValueError, match="workers.device=cuda, but this launch hides CUDA"):
        launch_local(_never, 2, device="cuda")
    assert launch_local(lambda ctx: ctx.device, 1, device="auto", in_process=True, hide_cuda=False) == [
        torch.device("cuda", 0)]
    assert host.calls == [("set_device", torch.device("cuda", 0))]  # one in-process worker: no group


def test_the_single_in_process_worker_gets_its_device_in_comm(host):
    spec = SimpleNamespace(config=SimpleNamespace(workers=SimpleNamespace(
        num_workers=1, threads_per_worker=1, timeout_s=60.0, start_method="spawn", launcher="local", device="cuda")))
    seen = launch(spec, lambda spec, comm, stop, on_step: {"device": comm.device})
    assert seen == {"device": torch.device("cuda", 0)}


def test_resolved_workers_never_say_auto(host):
    workers = WorkersConfig(launcher="auto", num_workers=2, device="auto")
    assert (resolved_workers(workers, {}).launcher, resolved_workers(workers, {}).device) == ("local", "cuda")
    host.cuda = False
    assert resolved_workers(workers, {}).device == "cpu"
    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "5",
            "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    host.cuda = True
    with pytest.raises(ValueError, match="local rank 5 has no GPU"):
        resolved_workers(WorkersConfig(launcher="auto", num_workers=8, device="cuda"), srun)


def test_train_with_cuda_and_no_cuda_fails_before_any_work(host, tmp_path, capsys):
    host.cuda = False
    run_dir = tmp_path / "run"
    assert main(["conf/demo.yaml", f"run_dir={run_dir}", "workers.device=cuda"]) == 2
    assert "workers.device=cuda" in capsys.readouterr().err
    assert not run_dir.exists()


def test_forked_ranks_are_never_put_on_cuda_and_the_probe_does_not_initialise_it(host, monkeypatch):
    """A fork launch that would compute on CUDA is refused before any rank starts; the
    probe goes through NVML (PYTORCH_NVML_BASED_CUDA_CHECK), so it cannot poison fork."""
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: seen.append(__import__("os").environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")) or True)
    workers = WorkersConfig(num_workers=2, start_method="fork", device="auto")
    with pytest.raises(ValueError, match=r"workers\.start_method=spawn"):
        resolved_workers(workers, env={})
    assert seen[:1] == ["1"]
    with pytest.raises(ValueError, match=r"start_method=fork cannot start workers\.device=cuda"):
        WorkersConfig(num_workers=2, start_method="fork", device="cuda")
    assert resolved_workers(WorkersConfig(num_workers=2, start_method="spawn", device="auto"), env={}).device == "cuda"


def test_forked_ranks_cannot_hide_the_gpus_so_a_fork_launch_that_would_is_refused(host, monkeypatch):
    """``hide_cuda`` works by the children's ``CUDA_VISIBLE_DEVICES``; a forked child keeps the
    launcher's view of CUDA instead, so a CPU fork launch on a GPU host is refused (probed
    through NVML) before any rank starts; on a host without CUDA it runs."""
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: seen.append(__import__("os").environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")) or host.cuda)
    with pytest.raises(ValueError, match="start_method=fork cannot hide this host's GPUs"):
        launch_local(_never, 2, start_method="fork")
    assert seen == ["1"] and not multiprocessing.active_children()
    host.cuda = False
    assert launch_local(lambda ctx: ctx.device, 2, start_method="fork", timeout_s=60) == [torch.device("cpu")] * 2
