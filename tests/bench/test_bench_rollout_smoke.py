"""`nemo-tlt bench rollout` (both workloads) end to end on tiny cached assets."""
from __future__ import annotations

import json

import pytest

import nemo_tlt.bench.longtail as longtail
import nemo_tlt.bench.rollout as rollout
from nemo_tlt.rl.assets import AssetConfig
from nemo_tlt.drafter.train import DrafterTrainConfig
from nemo_tlt.model.config import LMConfig
from nemo_tlt.rl.sft import SFTConfig
from nemo_tlt.rl.tasks import TaskConfig

pytest.importorskip("transformers")


def tiny_assets() -> AssetConfig:
    lm = dict(vocab_size=57, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
              max_position_embeddings=160)
    return AssetConfig(target=LMConfig(num_layers=2, **lm), assistant=LMConfig(num_layers=1, **lm),
                       task=TaskConfig(name="arith", max_solution_chars=100),
                       sft=SFTConfig(steps=4, batch_size=4, warmup_steps=1, seq_len=160), sft_examples=16,
                       drafter_prompts=4, drafter_max_new_tokens=24,
                       drafter_train=DrafterTrainConfig(steps=3, batch_size=4, warmup_steps=1))


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    monkeypatch.setattr(rollout, "AssetConfig", tiny_assets)
    monkeypatch.setattr(longtail, "AssetConfig", tiny_assets)
    return tmp_path


def test_default_workload(tiny):
    out = tiny / "r.json"
    assert rollout.main(["--out", str(out), "--num-prompts", "2", "--max-new-tokens", "12", "--shape", "3_2_4",
                         "--cache-dir", str(tiny / "cache")]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"plain", "sd_greedy", "sd_rejection", "sd_coupled", "hf_generate",
                                       "hf_assisted", "plain_rejection", "plain_coupled"}
    assert payload["coupled_outputs_identical"] is True
    for r in payload["results"].values():
        assert {"tokens_per_s", "target_forwards_per_token", "mean_accept_len", "wall_s"} <= set(r)
    assert payload["greedy_outputs_identical"] is True
    assert payload["results"]["sd_greedy"]["target_forwards_per_token"] < 1.0


def test_longtail_workload(tiny):
    out = tiny / "lt.json"
    assert rollout.main(["--workload", "longtail", "--out", str(out), "--num-prompts", "3", "--group-size", "2",
                         "--max-new-tokens", "16", "--arms", "2_1_2,3_2_4", "--threshold-on", "3",
                         "--threshold-off", "4", "--bucket-edges", "2", "--cache-dir", str(tiny / "cache")]) == 0
    payload = json.loads(out.read_text())
    assert {"longtail_plain", "longtail_fixed_2_1_2", "longtail_fixed_3_2_4", "longtail_adaptive"} == set(
        payload["results"])
    assert payload["outputs_identical"] is True
    assert payload["trace"] and (tiny / "lt.png").is_file()
    assert all(len(r["wall_s_rounds"]) == 5 for r in payload["results"].values())
    assert 0.0 <= payload["step_time_exponent"] <= 1.0 and payload["headroom"]["oracle_vs_best_fixed"] <= 1.0


def test_median_round_is_the_middle_wall_time():
    rounds = [({"wall_s": w}, f"trace{w}") for w in (3.0, 1.0, 5.0, 2.0)]
    assert longtail.median_round(rounds) == ({"wall_s": 2.0}, "trace2.0")   # lower middle of 4
    assert longtail.median_round(rounds[:3]) == ({"wall_s": 3.0}, "trace3.0")


def test_bad_shape_is_refused(tiny):
    with pytest.raises(ValueError, match="--shape"):
        rollout.main(["--out", str(tiny / "x.json"), "--shape", "8_4"])
