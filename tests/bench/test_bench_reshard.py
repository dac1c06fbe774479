"""`nemo-tlt bench reshard` on a tiny model (the full run: docs/benchmarks.md): bit-exact, every
rank receives at most 1.1 x its rollout slice, and the bytes it reports per rank (the reshard's
own meter) and `nemo-tlt plan`'s accounting are the bytes that crossed the process group,
counted at torch.distributed's calls in every rank (tests/wire_bytes.py)."""
from __future__ import annotations

import functools
import json
import pickle

import pytest

from wire_bytes import counted_call


@pytest.mark.parametrize("receivers", ["first", "all"])
def test_bench_reshard_reports_slice_only_traffic(tmp_path, receivers, monkeypatch):
    pytest.importorskip("megatron.core")
    from nemo_tlt.bench import reshard as bench

    wire = []  # per rank: {"stream-<i>" / "gather-<i>": (received, sent)}, i the rollout TP's index
    launch = bench.launch_local

    def launch_counted(fn, world, *args, **kwargs):
        # the ranks run forked here; the benchmark's default, spawn (what the recorded figures
        # use), sends the rank function and its arguments pickled: they must survive that
        assert kwargs["start_method"] == "fork"
        assert pickle.loads(pickle.dumps((fn, args)))[0] is fn
        per_rank = launch(functools.partial(counted_call, fn), world, *args, **kwargs)
        wire.extend(r["wire"] for r in per_rank)
        return [r["result"] for r in per_rank]

    monkeypatch.setattr(bench, "launch_local", launch_counted)
    out = tmp_path / "reshard.json"
    rc = bench.main(["--out", str(out), "--hidden", "32", "--layers", "4", "--heads", "8", "--kv-heads", "4",
                     "--ffn", "64", "--vocab", "300", "--rollout-tps", "1,2,4", "--receivers", receivers,
                     "--timeout-s", "90", "--start-method", "fork"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["bit_exact"] and report["within_target"]
    model = report["model_bytes"]
    assert len(wire) == 4
    for i, (name, target) in enumerate(report["by_target"].items()):
        rtp = target["rollout_tp"]
        received = target["bytes_received_per_rank"]
        assert len(received) == 4 and name == f"tp{rtp}"
        assert max(received) <= 1.1 * model / rtp, (rtp, received)
        stream_wire = [w[f"stream-{i}"][0] for w in wire]
        assert received == stream_wire == target["planned_bytes_received_per_rank"], (rtp, received, stream_wire)
        assert sum(w[f"stream-{i}"][1] for w in wire) == sum(stream_wire)
        # the gather reference sends every receiver (nearly) the whole model
        assert target["gather_bytes_received_per_rank"] == [w[f"gather-{i}"][0] for w in wire], rtp
        assert max(target["gather_bytes_received_per_rank"]) > 0.7 * model
