"""``nemo-tlt selfcheck``: refuses ``--gpu`` without CUDA (exit 2, nothing written), and its
every check runs on the CPU at toy sizes (``--cpu-dry-run``), writing one JSON."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.selfcheck.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: --gpu would run")
def test_gpu_mode_without_cuda_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "selfcheck.json"
    assert main(["--gpu", "--out", str(out)]) == 2
    assert "no CUDA device here" in capsys.readouterr().out and not out.exists()


def test_unknown_check_is_refused_by_name(tmp_path, capsys):
    assert main(["--cpu-dry-run", "--out", str(tmp_path / "x.json"), "--only", "engine_demo_float32,warp"]) == 2
    assert "['warp']" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_cpu_dry_run_passes_every_check_and_says_it_is_not_a_gpu_run(tmp_path):
    out = tmp_path / "selfcheck.json"
    assert main(["--cpu-dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["mode"] == "cpu_dry_run" and "says nothing about a GPU" in report["note"]
    checks = report["checks"]
    assert set(checks) == {"engine_demo_float32", "engine_demo_bfloat16", "engine_random_float32",
                           "engine_random_bfloat16", "main_job", "megatron_world1", "checkpoint_roundtrip"}
    assert all(c["status"] == "passed" for c in checks.values()), {k: c.get("error") for k, c in checks.items()}
    for name in ("engine_demo_float32", "engine_random_float32"):  # fp32: SD is plain decoding, token for token
        ident = checks[name]["result"]["identity"]
        assert ident["greedy"]["all_identical"] and ident["coupled"]["all_identical"], name
    assert checks["main_job"]["result"]["config_device_line"] == "device: cpu"
    assert checks["main_job"]["result"]["rewards_identical"] is True
