"""Legacy ``mp_rank_XX[_YYY]`` Megatron checkpoints -> canonical, and via ``nemo-tlt convert``.

Files are written as Megatron-LM's ``save_checkpoint`` (``--ckpt-format torch``)
writes them: ``args`` namespace, ``checkpoint_version``, ``iteration``, ``model``,
``rng_state`` (python / numpy / torch RNG states), ``opt_param_scheduler``. They
must load without ``--trust-pickle``; a file holding any other Python object
must not be unpickled without it.
"""
from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.convert import main
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.legacy import legacy_to_canonical, read_legacy_shards
from nemo_tlt.weights.megatron_layout import canonical_to_megatron
from nemo_tlt.weights.megatron_pickle import UntrustedPickleError

from test_megatron_layout import random_canonical


@pytest.fixture(autouse=True)
def _no_process_wide_safe_globals():
    """Importing megatron.core allow-lists its types for the whole process; clear that here,
    so these tests see only the reader's own allow-list. It is imported first, so that its
    one-time registration cannot happen inside a test, and is restored afterwards."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pass  # nothing registered process-wide then
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(saved)


def _megatron_args(layout: ParallelLayout, **extra) -> argparse.Namespace:
    return argparse.Namespace(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                              num_layers=3, hidden_size=64, params_dtype=torch.bfloat16, ckpt_format="torch",
                              save="/checkpoints/run", **extra)


def _rng_state() -> list[dict]:
    return [{"random_rng_state": random.Random(0).getstate(),
             "np_rng_state": np.random.RandomState(0).get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.get_rng_state(),  # a ByteTensor like the CUDA one (no CUDA here)
             "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]


def _write_legacy(root, shards, layout: ParallelLayout, iteration: int = 42, **args_extra):
    it = root / f"iter_{iteration:07d}"
    for (p, t), shard in shards.items():
        name = f"mp_rank_{t:02d}" if layout.pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        (it / name).mkdir(parents=True)
        torch.save({"args": _megatron_args(layout, **args_extra), "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "model": {**shard, "decoder.layers.0.mlp.linear_fc1._extra_state": None},
                    "rng_state": _rng_state(),
                    "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "num_steps": 4200,
                                            "decay_style": "cosine"},
                    "num_floating_point_operations_so_far": 1.5e15},
                   it / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


class _NotMegatron:
    """Unpickling this runs _touch: what a hostile checkpoint could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return _touch, (self.marker,)


def _touch(marker: str) -> str:
    with open(marker, "w") as f:
        f.write("code from the checkpoint ran")
    return marker


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


def test_megatron_core_enums_in_args_load_without_trust(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    cfg = LMConfig(num_layers=2)
    canonical = random_canonical(cfg)
    layout = ParallelLayout(1, 1)
    _write_legacy(tmp_path, canonical_to_megatron(canonical, cfg, layout), layout,
                  attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder)
    back = legacy_to_canonical(tmp_path, cfg)
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_other_pickled_objects_need_trust_pickle(tmp_path, capsys):
    cfg = LMConfig(num_layers=2)
    canonical = random_canonical(cfg)
    layout = ParallelLayout(1, 1)
    marker = tmp_path / "ran"
    _write_legacy(tmp_path / "ckpt", canonical_to_megatron(canonical, cfg, layout), layout,
                  tokenizer=_NotMegatron(str(marker)))
    with pytest.raises(UntrustedPickleError, match=r"mp_rank_00/model_optim_rng\.pt: refusing to unpickle "
                                                   r"test_legacy\._touch(.|\n)*--trust-pickle"):
        read_legacy_shards(tmp_path / "ckpt")
    assert not marker.exists()

    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    argv = ["--from", "legacy", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"),
            "--hf-config", str(tmp_path / "config.json")]
    assert main(argv) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()

    assert main([*argv, "--trust-pickle"]) == 0
    assert marker.exists()  # full pickle ran the file's code, as the flag says it may
    back = read_state_dict(tmp_path / "hf")
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)
