"""`nemo-tlt bench memory` at its smallest size (one layout), and its measure: tracked tensor
memory per phase counts the storages live at the start and the peak of what the phase
allocates, transients included."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.bench.tracked_memory import PhaseMemory, live_tensor_bytes, peak_change
from nemo_tlt.plan.rank_memory import PHASES

MB = 2**20


def test_peak_change_follows_events_in_time_order():
    assert peak_change([(3, -4), (1, 10), (2, 5)]) == (15, 11)
    assert peak_change([]) == (0, 0)


def test_phase_counts_live_storages_and_transient_peak():
    held = torch.ones(MB // 4)  # 1 MiB live before the phase
    view = held[:10]  # a view: its storage counted once
    assert live_tensor_bytes() >= MB
    memory = PhaseMemory()
    with memory.phase("x"):
        kept = torch.empty(2 * MB, dtype=torch.uint8)
        transient = torch.empty(3 * MB, dtype=torch.uint8)
        del transient
    parts = memory.parts["x"]
    assert parts["start_bytes"] >= MB
    assert parts["peak_change_bytes"] == 5 * MB and parts["end_change_bytes"] == 2 * MB
    assert memory.peaks["x"] == parts["start_bytes"] + 5 * MB
    with memory.phase("warm-up", measure=False):
        pass
    assert "warm-up" not in memory.peaks
    del kept, view


@pytest.mark.timeout(120)
def test_bench_memory_smallest(tmp_path):
    pytest.importorskip("megatron.core")
    from nemo_tlt.bench.memory import main

    out = tmp_path / "memory.json"
    code = main(["--out", str(out), "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                 "--ffn", "64", "--vocab", "128", "--prompts", "2", "--group", "2", "--prompt-len", "4",
                 "--max-new", "4", "--micro-batch", "2", "--layouts", "tp2_rollout_tp1", "--start-method", "fork"])
    summary = json.loads(out.read_text())
    assert code == (0 if summary["within_target"] else 1)
    layout = summary["layouts"]["tp2_rollout_tp1"]
    comparison = layout["comparison"]
    assert sorted(comparison["per_rank"]) == ["0", "1"]
    for rank, phases in comparison["per_rank"].items():
        assert tuple(phases) == PHASES
        for phase, row in phases.items():
            terms = layout["predicted_terms_bytes"][rank][phase]
            assert row["predicted_bytes"] == pytest.approx(sum(terms.values()))
            assert row["measured_bytes"] > 0
            assert row["ratio"] == pytest.approx(row["predicted_bytes"] / row["measured_bytes"], abs=1e-4)
            assert row["within"] == (abs(row["ratio"] - 1) <= summary["tolerance"])
        # the engine's KV cache and the update's transients are seen beyond what the phase starts with
        parts = layout["measured_parts"][rank]
        assert parts["rollout"]["peak_change_bytes"] > 0 and parts["update"]["peak_change_bytes"] > 0
    assert set(comparison["per_phase"]) == set(PHASES)
    assert set(layout["plan_as_printed"]["per_phase"]) == set(PHASES)
