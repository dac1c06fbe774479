"""Legacy ``mp_rank_XX[_YYY]`` Megatron checkpoints -> canonical, and via ``nemo-tlt convert``."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.weights.convert_cli import main
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.legacy import legacy_to_canonical, read_legacy_shards
from nemo_tlt.weights.megatron_layout import canonical_to_megatron

from test_megatron_layout import random_canonical


def _write_legacy(root, shards, layout: ParallelLayout, iteration: int = 42):
    it = root / f"iter_{iteration:07d}"
    for (p, t), shard in shards.items():
        name = f"mp_rank_{t:02d}" if layout.pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        (it / name).mkdir(parents=True)
        torch.save({"model": {**shard, "decoder.layers.0.mlp.linear_fc1._extra_state": None},
                    "iteration": iteration}, it / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("layout", [ParallelLayout(2, 1), ParallelLayout(2, 2, num_layers_in_first_stage=1)],
                         ids=["tp2", "tp2pp2uneven"])
def test_legacy_round_trip(tmp_path, layout):
    cfg = LMConfig(family="qwen2", num_layers=3, vocab_size=100)
    canonical = random_canonical(cfg)
    _write_legacy(tmp_path, canonical_to_megatron(canonical, cfg, layout), layout)
    _, found = read_legacy_shards(tmp_path)
    assert found == layout
    back = legacy_to_canonical(tmp_path, cfg)
    assert set(back) == set(canonical) and all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_cli_legacy_to_hf(tmp_path):
    cfg = LMConfig(num_layers=2)
    canonical = random_canonical(cfg)
    _write_legacy(tmp_path / "ckpt", canonical_to_megatron(canonical, cfg, ParallelLayout(2, 1)), ParallelLayout(2, 1))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    out = tmp_path / "hf"
    assert main(["--from", "legacy", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(out)]) == 2
    assert not out.exists()  # --hf-config missing: refused, nothing written
    assert main(["--from", "legacy", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(out),
                 "--hf-config", str(tmp_path / "config.json")]) == 0
    back = read_state_dict(out)
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_missing_rank_folder_is_reported(tmp_path):
    cfg = LMConfig(num_layers=2)
    shards = canonical_to_megatron(random_canonical(cfg), cfg, ParallelLayout(2, 2))
    del shards[(1, 0)]
    _write_legacy(tmp_path, shards, ParallelLayout(2, 2))
    with pytest.raises(ValueError, match=r"rank folders missing for \(pp, tp\) \[\(1, 0\)\]"):
        read_legacy_shards(tmp_path)
