"""`nemo-tlt bench reshard` on a tiny model (the full run: docs/benchmarks.md): bit-exact, every
rank receives at most 1.1 x its rollout slice, and `nemo-tlt plan`'s accounting gives the same
bytes per rank as the reshard's own meter."""
from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("receivers", ["first", "all"])
def test_bench_reshard_reports_slice_only_traffic(tmp_path, receivers):
    pytest.importorskip("megatron.core")
    from nemo_tlt.bench.reshard import main

    out = tmp_path / "reshard.json"
    rc = main(["--out", str(out), "--hidden", "32", "--layers", "4", "--heads", "8", "--kv-heads", "4",
               "--ffn", "64", "--vocab", "300", "--rollout-tps", "1,2,4", "--receivers", receivers,
               "--timeout-s", "240"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["bit_exact"] and report["within_target"]
    model = report["model_bytes"]
    for name, target in report["by_target"].items():
        rtp = target["rollout_tp"]
        received = target["bytes_received_per_rank"]
        assert len(received) == 4 and name == f"tp{rtp}"
        assert max(received) <= 1.1 * model / rtp, (rtp, received)
        assert received == target["planned_bytes_received_per_rank"], rtp
        # the gather reference sends every receiver (nearly) the whole model
        assert max(target["gather_bytes_received_per_rank"]) > 0.7 * model
