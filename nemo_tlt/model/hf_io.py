"""Load and save HF-format model folders (config.json + safetensors) from a local path.

No hub access: a folder on disk is the only source. Sharded safetensors with an
index file are read; saving writes one `model.safetensors`. Saving is atomic:
a temporary folder is renamed into place.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.atomic import atomic_output_dir
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM


def read_config(path: str | os.PathLike) -> LMConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no config.json in the model folder")
    with open(cfg_path) as f:
        return LMConfig.from_hf_config(json.load(f), source=str(cfg_path))


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def load_hf_folder(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DecoderLM:
    config = read_config(path)
    model = DecoderLM(config)
    state = read_state_dict(path)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(dtype)


def save_hf_folder(model: DecoderLM, path: str | os.PathLike, overwrite: bool = True,
                   extra_files: dict[str, str] | None = None) -> Path:
    with atomic_output_dir(path, overwrite=overwrite) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with open(tmp / "config.json", "w") as f:
            json.dump(model.config.to_hf_config(), f, indent=2)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(path)
