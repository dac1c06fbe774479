"""The GPU half, on a real CUDA device (``pytest -m gpu``; skipped where there is none).

Each test runs one check of ``nemo-tlt selfcheck --gpu`` (``nemo_tlt.selfcheck``) at a size
that takes seconds: the embedded engine on ``cuda:0`` (SD token-identical to plain decoding
in fp32; bf16 runs), the megatron backend at world size 1 over NCCL, a one-worker RL run
in bf16 on the GPU, and a run checkpoint of CUDA tensors. Not run on the project's CPU
machines; docs/gpu.md records where and when it last ran.
"""
from __future__ import annotations


import pytest
import torch

from nemo_tlt.selfcheck import engine_check as ec
from nemo_tlt.selfcheck import system_checks as sc
from nemo_tlt.selfcheck.cli import DRY_RUN_SIZES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu on a GPU node)")]
CUDA = torch.device("cuda", 0)


def _case(tmp_path):
    s = DRY_RUN_SIZES
    return ec.random_case(s.kernel_model, tmp_path / "model", 8, 8, 24)


def test_engine_on_cuda_fp32_sd_is_plain_decoding(tmp_path):
    out = ec.engine_check(_case(tmp_path), CUDA, torch.float32, (1, 8), with_hf=False)
    assert out["identity"]["greedy"]["all_identical"] and out["identity"]["coupled"]["all_identical"]


def test_engine_on_cuda_bf16_runs(tmp_path):
    out = ec.engine_check(_case(tmp_path), CUDA, torch.bfloat16, (8,), with_hf=False)
    assert out["throughput"][0]["plain_tokens_per_s"] > 0


def test_kernel_checks_run_on_cuda_at_toy_sizes():
    """The 7B checks' code on the GPU at the dry run's sizes: kernels named, costs and peak memory."""
    from nemo_tlt.selfcheck import kernel_checks as kc

    s = DRY_RUN_SIZES
    assert all(kc.sdpa_probe(s.kernel_model, CUDA, torch.bfloat16, s.prompt_len).values())
    cost = kc.decode_cost(s.kernel_model, CUDA, torch.bfloat16, s.decode_batches, s.prompt_len, s.decode_max_new,
                          s.decode_warm, 0.25)
    assert all(row["peak_memory_gib"] > 0 and row["ms_per_step"] > 0 for row in cost["batches"])


def test_megatron_at_world_size_one_over_nccl():
    pytest.importorskip("megatron.core")
    out = sc.megatron_check("cuda", DRY_RUN_SIZES.megatron_model)
    assert out["max_weight_diff"] <= out["tolerance"]


def test_one_worker_rl_run_in_bf16_on_the_gpu_keeps_tlt_equal_to_the_baseline(tmp_path):
    """bf16 weights with fp32 arithmetic in the engine: TLT and baseline identical."""
    out = sc.main_job_check("cuda", tmp_path / "run", (*DRY_RUN_SIZES.main_job_overrides, "model.dtype=bfloat16",
                                                       "rollout.compute_dtype=float32"))
    assert out["config_device_line"] == "device: cuda"
    assert out["rewards_identical"] is True and out["rollouts_identical"] is True


def test_run_checkpoint_of_cuda_tensors_round_trips(tmp_path):
    out = sc.checkpoint_check(CUDA, tmp_path / "ckpt")
    assert out["weights_equal"] and out["optimizer_state_equal"] and out["optimizer_state_device"].startswith("cuda")
