"""`nemo-tlt plan CONFIG --sensitivity`: every assumption at both ends of its range."""
from __future__ import annotations

from pathlib import Path

from nemo_tlt.plan.cli import main
from nemo_tlt.plan.sensitivity import RANGES

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_every_assumption_at_both_ends(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(CONF.parent)
    out = tmp_path / "s.json"
    assert main([str(CONF / "qwen2.5-32b_plan.yaml"), "steps=1", "--sensitivity", "--markdown", "--out", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    rows = {r["assumption"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(RANGES) and len(rows) == len(result["rows"])
    expected = {"sd.accepted", "sd.drift", "sd.recover_gpu_s", "cluster.flops_efficiency",
                "cluster.hbm_efficiency", "lengths.median", "lengths.sigma"}
    assert expected <= set(rows)
    for name, r in rows.items():
        assert (r["low"], r["high"]) == RANGES[name][:2] and r["low"] < r["high"]
        for end in ("at_low", "at_high"):
            assert r[end]["speedup"] > 0 and r[end]["speedup_pipelined"] >= r[end]["speedup"] - 1e-9
    # the accepted lengths move the prediction the way they must
    assert rows["sd.accepted"]["at_low"]["speedup"] < result["planned"]["speedup"] < rows["sd.accepted"]["at_high"]["speedup"]
    assert rows["lengths.median"]["at_low"]["speedup"] != rows["lengths.median"]["at_high"]["speedup"]
    assert "| `lengths.sigma`" in capsys.readouterr().out
