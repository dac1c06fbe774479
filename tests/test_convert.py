"""``nemo-tlt convert``: HF <-> torch_dist round trip (real megatron-core), HF -> TensorRT-LLM, clear errors.

A failed conversion must leave no output folder; an existing output is refused
without --overwrite.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.convert import main

# tests/ is on sys.path (conftest.py); "tests." would find nemo-aligner's top-level tests package
from weights.test_megatron_layout import random_canonical


def _hf_folder(path, cfg: LMConfig, state: dict | None = None):
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    save_file(state if state is not None else random_canonical(cfg), str(path / "model.safetensors"))
    return path


@pytest.mark.timeout(180)
def test_hf_torch_dist_hf_round_trip_is_bit_exact_bf16(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from nemo_tlt import convert as convert_cli
    from ranks import launch_forked

    # The gloo ranks forked where there is no CUDA (tests/ranks.py): they inherit megatron-core
    # instead of importing it again (about 5 s a launch here). What this test checks, the values,
    # dtypes and config through TP 2 and back, does not depend on how the ranks start; convert's
    # own spawned ranks are run by test_torch_dist_round_trip_on_a_gpu_host (save and load).
    monkeypatch.setattr(convert_cli, "launch_local", launch_forked)
    cfg = LMConfig(family="qwen2", vocab_size=100, num_heads=4, num_kv_heads=2)
    # bf16 weights: the round trip must keep the dtype (norms included), not only the values.
    src = _hf_folder(tmp_path / "hf", cfg, {k: v.bfloat16() for k, v in random_canonical(cfg).items()})
    assert main(["--from", "hf", "--to", "torch_dist", "--tp", "2", "--input", str(src),
                 "--output", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "metadata.json").is_file()
    assert main(["--from", "torch_dist", "--to", "hf", "--input", str(tmp_path / "ckpt"),
                 "--output", str(tmp_path / "back")]) == 0
    original, back = read_state_dict(src), read_state_dict(tmp_path / "back")
    assert set(back) == set(original)
    for name in original:
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], original[name]), name
    assert LMConfig.from_hf_config(json.loads((tmp_path / "back" / "config.json").read_text())) == cfg
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def _on_gpu_host(worker: str, seen: str, ctx, *args) -> None:
    """Run convert_cli's ``worker`` in a gloo child as it runs on a GPU host: there torch sees
    the GPU unless CUDA_VISIBLE_DEVICES is empty, and the CPU shims refuse to run where it does.
    Records the CUDA_VISIBLE_DEVICES this child started with in ``seen``."""
    from nemo_tlt import convert as convert_cli

    with open(f"{seen}.{ctx.rank}", "w") as f:
        json.dump(os.environ.get("CUDA_VISIBLE_DEVICES"), f)
    torch.cuda.is_available = lambda: os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    getattr(convert_cli, worker)(ctx, *args)


@pytest.mark.timeout(180)
def test_torch_dist_round_trip_on_a_gpu_host(tmp_path, monkeypatch):
    """Conversion must not trip the CPU shims' refusal on a machine with a GPU: its gloo
    processes start with the GPU hidden. The GPU host is simulated in the parent and, through
    _on_gpu_host, in the children (only the parent's monkeypatch would not reach them)."""
    pytest.importorskip("megatron.core")
    from nemo_tlt import convert as convert_cli

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for worker in ("_save_worker", "_load_worker"):
        monkeypatch.setattr(convert_cli, worker, functools.partial(_on_gpu_host, worker, str(tmp_path / worker)))
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    src = _hf_folder(tmp_path / "hf", cfg)
    assert main(["--from", "hf", "--to", "torch_dist", "--input", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    assert main(["--from", "torch_dist", "--to", "hf", "--input", str(tmp_path / "ckpt"),
                 "--output", str(tmp_path / "back")]) == 0
    original, back = read_state_dict(src), read_state_dict(tmp_path / "back")
    assert all(torch.equal(back[k], original[k]) for k in original)
    for worker in ("_save_worker", "_load_worker"):
        assert json.loads((tmp_path / f"{worker}.0").read_text()) == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the parent's own setting is untouched


def test_hf_to_trtllm(tmp_path):
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    src = _hf_folder(tmp_path / "hf", cfg)
    out = tmp_path / "trt"
    assert main(["--from", "hf", "--to", "trtllm", "--tp", "2", "--input", str(src), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    # Refused without --overwrite, accepted with it.
    assert main(["--from", "hf", "--to", "trtllm", "--input", str(src), "--output", str(out)]) == 2
    assert main(["--from", "hf", "--to", "trtllm", "--input", str(src), "--output", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors"]


def test_clear_errors_and_no_partial_output(tmp_path, capsys):
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    good = _hf_folder(tmp_path / "good", cfg)
    out = tmp_path / "out"

    assert main(["--from", "hf", "--to", "trtllm", "--tp", "4", "--input", str(good), "--output", str(out)]) == 2
    assert "TP=4 does not divide num_kv_heads" in capsys.readouterr().err

    state = random_canonical(cfg)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    bad = _hf_folder(tmp_path / "bad_shape", cfg, state)
    assert main(["--from", "hf", "--to", "trtllm", "--input", str(bad), "--output", str(out)]) == 2
    assert "model.layers.0.mlp.up_proj.weight has shape (3, 64)" in capsys.readouterr().err

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({**cfg.to_hf_config(), "architectures": ["GPT2LMHeadModel"],
                                                     "model_type": "gpt2"}))
    assert main(["--from", "hf", "--to", "trtllm", "--input", str(unknown), "--output", str(out)]) == 2
    assert "unknown model family" in capsys.readouterr().err

    assert main(["--from", "torch_dist", "--to", "trtllm", "--input", str(good), "--output", str(out)]) == 2
    assert "not supported" in capsys.readouterr().err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_shape", "good", "unknown"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import nemo_tlt.weights.trtllm as trtllm

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    cfg = LMConfig()
    src = _hf_folder(tmp_path / "hf", cfg)
    monkeypatch.setattr(trtllm, "write_trtllm_files", explode)
    assert main(["--from", "hf", "--to", "trtllm", "--input", str(src), "--output", str(tmp_path / "o")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_megatron_routes_refuse_what_megatron_cannot_hold(tmp_path, capsys):
    from nemo_tlt.model.config import RopeScaling

    out = tmp_path / "out"
    o_bias = _hf_folder(tmp_path / "o_bias", LMConfig(family="llama", qkv_bias=True))
    assert main(["--from", "hf", "--to", "torch_dist", "--input", str(o_bias), "--output", str(out)]) == 2
    assert "LMConfig.o_proj_bias is True" in capsys.readouterr().err
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    assert main(["--from", "legacy", "--to", "hf", "--input", str(legacy), "--hf-config",
                 str(o_bias / "config.json"), "--output", str(out)]) == 2
    assert "LMConfig.o_proj_bias is True" in capsys.readouterr().err
    scaled = _hf_folder(tmp_path / "scaled", LMConfig(rope_scaling=RopeScaling(high_freq_factor=8.0)))
    assert main(["--from", "hf", "--to", "torch_dist", "--input", str(scaled), "--output", str(out)]) == 2
    assert "LMConfig.rope_scaling.high_freq_factor=8.0" in capsys.readouterr().err
    assert not out.exists()
