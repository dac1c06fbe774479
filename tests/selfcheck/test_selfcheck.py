"""``nemo-tlt selfcheck``: refuses ``--gpu`` without CUDA and ``--trtllm`` without TensorRT-LLM (exit 2,
nothing written); every ``--gpu`` check runs on the CPU at toy sizes (``--cpu-dry-run``), writing one
JSON; ``--trtllm``'s checks run on the stand-in TensorRT-LLM module (tests/trtllm_standin.py; it never
ran on TensorRT-LLM itself)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from nemo_tlt.selfcheck import cli
from nemo_tlt.rollout.trtllm_config import TRTLLM_INSTALL
from nemo_tlt.selfcheck import trtllm_check as tc
from nemo_tlt.selfcheck.cli import main
import trtllm_standin


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: --gpu would run")
def test_gpu_mode_without_cuda_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "selfcheck.json"
    assert main(["--gpu", "--out", str(out)]) == 2
    assert "no CUDA device here" in capsys.readouterr().out and not out.exists()


def test_unknown_check_is_refused_by_name(tmp_path, capsys):
    assert main(["--cpu-dry-run", "--out", str(tmp_path / "x.json"), "--only", "engine_demo_float32,warp"]) == 2
    assert "['warp']" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_cpu_dry_run_passes_every_check_and_says_it_is_not_a_gpu_run(tmp_path):
    out = tmp_path / "selfcheck.json"
    assert main(["--cpu-dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["mode"] == "cpu_dry_run" and "says nothing about a GPU" in report["note"]
    checks = report["checks"]
    assert list(checks) == list(cli.BUDGET_S)  # every --gpu check, in its order, each with its budget
    assert all(c["status"] == "passed" for c in checks.values()), {k: c.get("error") for k, c in checks.items()}
    for name in ("engine_demo_float32", "engine_demo_bfloat16_compute_float32"):
        ident = checks[name]["result"]["identity"]
        assert ident["greedy"]["all_identical"] and ident["coupled"]["all_identical"], name
    assert sum(cli.BUDGET_S.values()) <= 10 * 60 - 60  # a minute left for start-up in a 10-minute slot
    kv = checks["kv_fraction"]["result"]  # the budget bound, was kept, and (fp32 on the CPU) changed no token
    assert kv["kv_bytes_peak"] <= kv["budget_bytes"] < kv["kv_bytes_peak_unbounded"] and kv["identical_rate"] == 1.0
    kernels = checks["sdpa_probe"]["result"]
    assert set(kernels) == {"prefill", "decode", "verify"} and all(kernels.values())
    cost = checks["decode_cost"]["result"]
    assert [row["batch"] for row in cost["batches"]] == list(cli.DRY_RUN_SIZES.decode_batches)
    assert all(row["ms_per_step"] > 0 and row["roofline_ms"] > 0 for row in cost["batches"])
    # fp32 on the CPU: verifying a chain as one block, and batching, leave the logits within rounding
    assert checks["verify_vs_decode"]["result"]["argmax_agree_rate"] == 1.0
    assert checks["batch_invariance"]["result"]["argmax_agree_rate"] == 1.0
    assert checks["weight_sync"]["result"]["tensors"] > 0
    assert checks["main_job"]["result"]["config_device_line"] == "device: cpu"
    assert checks["main_job"]["result"]["rewards_identical"] is True


# ---- --trtllm: the TensorRT-LLM engine with the trained EAGLE-3 drafter (never run: no GPU here) ----
TRTLLM_CHECKS = ["eagle3_drafter", "trtllm_identity_greedy", "trtllm_acceptance", "trtllm_throughput",
                 "pytest_trtllm"]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed")
def test_trtllm_mode_without_tensorrt_llm_exits_2_with_the_install_message(tmp_path, capsys):
    out = tmp_path / "selfcheck.json"
    assert main(["--trtllm", "--out", str(out)]) == 2
    said = capsys.readouterr().out
    assert TRTLLM_INSTALL in said and "nothing was run" in said and not out.exists()


def test_trtllm_plan_names_its_checks_in_order(tmp_path):
    assert list(tc.trtllm_plan(tmp_path, None)) == TRTLLM_CHECKS


PASSING_PYTEST = "....s\n=========== 4 passed, 1 skipped in 3.10s ===========\n"


def cache_untrained_eagle3(cache: Path) -> None:
    """An untrained EAGLE-3 drafter for the shipped demo target, where `prepare_eagle3_drafter`
    looks for the trained one (training it takes about 105 CPU minutes): the checks take it
    for the trained drafter."""
    from nemo_tlt.demo.assets import AssetConfig, prepare_assets
    from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
    from nemo_tlt.drafter.io import save_drafter
    from nemo_tlt.model.hf_io import read_config

    config = AssetConfig()
    target = read_config(prepare_assets(config, cache, progress=False).target_dir)
    drafter = Eagle3Drafter(Eagle3Config.from_target(target, config.eagle3_capture_layers,
                                                     ttt_steps=config.eagle3_ttt_steps),
                            generator=torch.Generator().manual_seed(0))
    save_drafter(drafter, tc.cached_eagle3_dir(cache))


@pytest.fixture
def trtllm_here(monkeypatch, tmp_path):
    """--trtllm as if TensorRT-LLM and a GPU were present: ``import tensorrt_llm`` finds the stand-in
    module (tests/trtllm_standin.py, the torch engine behind TensorRT-LLM's LLM API) and every check's
    own body runs, at toy sizes (4 prompts, 16 new tokens, batches 1 and 4), on the shipped demo target
    with an untrained EAGLE-3 drafter in the cache. Replaced: the refusal (no CUDA here), the
    environment's GPU and package fields, and the subprocess of pytest_trtllm (a passing summary)."""
    from subprocess import CompletedProcess

    trtllm_standin.install(monkeypatch)
    monkeypatch.setattr(cli, "trtllm_refusal", lambda: None)
    monkeypatch.setattr(cli, "environment", lambda device: {"device": str(device)})
    monkeypatch.setattr(tc, "trtllm_environment", lambda: {"tensorrt_llm": "stand-in"})
    cache = tmp_path / "cache"
    cache_untrained_eagle3(cache)
    plan, run_pytest = tc.trtllm_plan, tc.pytest_trtllm
    monkeypatch.setattr(tc, "trtllm_plan", lambda work, cache_dir: plan(work, str(cache), prompts=4, max_new=16,
                                                                      batch_sizes=(1, 4)))
    monkeypatch.setattr(tc, "pytest_trtllm", lambda: run_pytest(
        run=lambda cmd, **kw: CompletedProcess(cmd, 0, PASSING_PYTEST, "")))


def test_trtllm_mode_records_each_check_into_one_json(tmp_path, trtllm_here):
    out = tmp_path / "selfcheck.json"
    assert main(["--trtllm", "--out", str(out), "--only", "eagle3_drafter,trtllm_acceptance"]) == 1
    report = json.loads(out.read_text())
    assert report["mode"] == "trtllm" and report["environment"]["tensorrt_llm"] == "stand-in"
    assert report["environment"]["device"] == "cuda:0" and "note" not in report and report["passed"] is False
    checks = report["checks"]
    assert list(checks) == ["eagle3_drafter", "trtllm_acceptance"]
    drafter = checks["eagle3_drafter"]
    assert drafter["status"] == "passed" and set(drafter) == {"status", "result", "seconds"}
    assert drafter["result"]["capture_layers"] == [1, 7, 12] and drafter["result"]["trained_here_s"] is None
    # the untrained drafter speculated (the stand-in drafted by the schedule) but hardly any draft was accepted
    assert checks["trtllm_acceptance"]["status"] == "failed"
    error = checks["trtllm_acceptance"]["error"]
    assert "speculation did not run" in error
    assert 1.0 <= float(re.search(r"mean accepted length (\S+) per verify step", error).group(1)) < 1.5
    assert int(re.search(r"'draft_tokens': (\d+)", error).group(1)) > 0
    assert main(["--trtllm", "--out", str(out), "--only", "pytest_trtllm"]) == 0
    assert json.loads(out.read_text())["checks"]["pytest_trtllm"]["result"]["summary"] == "4 passed, 1 skipped in 3.10s"


def test_trtllm_checks_run_their_bodies_on_the_stand_in(tmp_path, trtllm_here):
    """Identity: TensorRT-LLM greedy SD against its plain greedy (here also the torch engine's);
    throughput: tokens/s with and without the drafter per batch size, the drafter speculating."""
    out = tmp_path / "selfcheck.json"
    assert main(["--trtllm", "--out", str(out), "--only", "trtllm_identity_greedy,trtllm_throughput"]) == 0
    checks = json.loads(out.read_text())["checks"]
    identity = checks["trtllm_identity_greedy"]["result"]
    assert identity == {"sequences": 4, "identical_rate": 1.0, "all_identical": True, "draft_len": 4,
                        "torch_engine_plain_identical_rate": 1.0}
    rows = checks["trtllm_throughput"]["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(set(r) == {"batch", "order", "plain_tokens_per_s", "sd_tokens_per_s", "sd_mean_accept_len",
                          "sd_vs_plain"} and r["sd_mean_accept_len"] >= 1 for r in rows)  # the SD engine drafted
    assert [r["order"] for r in rows] == [["sd", "plain"], ["plain", "sd"]]  # alternating


def test_trtllm_mode_refuses_unknown_check_names(tmp_path, trtllm_here, capsys):
    assert main(["--trtllm", "--out", str(tmp_path / "x.json"), "--only", "trtllm_acceptance,engine_demo_float32"]) == 2
    assert "['engine_demo_float32']" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_pytest_summary_line_is_recorded_and_a_failing_run_fails():
    from subprocess import CompletedProcess

    ok = "....s\n=========== 4 passed, 1 skipped in 3.10s ===========\n"
    run = lambda cmd, **kw: CompletedProcess(cmd, 0, ok, "")  # noqa: E731
    result = tc.pytest_trtllm(run=run)
    assert result["summary"] == "4 passed, 1 skipped in 3.10s" and result["command"].startswith("pytest -q")
    assert "-m trtllm" in result["command"]
    skipped = "ss\n====== 2 skipped in 0.1s ======\n"
    with pytest.raises(AssertionError, match="2 skipped"):  # nothing passed: TensorRT-LLM did not run
        tc.pytest_trtllm(run=lambda cmd, **kw: CompletedProcess(cmd, 0, skipped, ""))
    with pytest.raises(AssertionError, match="exit 1"):
        tc.pytest_trtllm(run=lambda cmd, **kw: CompletedProcess(cmd, 1, "=== 1 failed in 2s ===\n", ""))


class _LossyEngine:
    """Stands in for an engine whose SD differs from its plain decoding in one sequence."""

    def __init__(self, compute_dtype):
        self.compute_dtype = compute_dtype

    def generate(self, requests, sampling, policy=None):
        from types import SimpleNamespace
        results = [SimpleNamespace(tokens=[5, 6] if policy is not None and i == 0 else [5, 7])
                   for i, _ in enumerate(requests)]
        return SimpleNamespace(results=results, stats=SimpleNamespace(mean_accept_len=2.0))


def test_identity_fails_the_check_in_fp32_arithmetic_and_is_recorded_in_bf16(tmp_path):
    from nemo_tlt.selfcheck import engine_check as ec
    from nemo_tlt.speculative.tree_shape import TreeShape

    case = ec.EngineCase("lossy", tmp_path, None, [[3, 4], [3, 5]], TreeShape(depth=2, topk=1, num_verify=2), 4)
    with pytest.raises(AssertionError, match="not token-identical"):
        ec.identity(_LossyEngine(torch.float32), case, seed=0)
    out = ec.identity(_LossyEngine(torch.bfloat16), case, seed=0)
    assert out["greedy"]["identical_rate"] == 0.5 and not out["greedy"]["all_identical"]
