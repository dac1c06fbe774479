"""Save and load drafters: `drafter.json` (kind + config) beside `drafter.safetensors`.

Only the drafter's own parameters are stored; the embedding and LM head belong to
the target. Loading checks the weights against the config and, when a target is
given, the config against the target, with errors that name the file and tensor.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.atomic import atomic_output_dir
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.medusa import MedusaConfig, MedusaDrafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM


def drafter_config_dict(drafter: torch.nn.Module) -> dict:
    if isinstance(drafter, EagleDrafter):
        return {"kind": "eagle", "layer": drafter.config.layer.to_dict()}
    if isinstance(drafter, Eagle3Drafter):
        return {"kind": "eagle3", **drafter.config.to_dict()}
    if isinstance(drafter, MedusaDrafter):
        return {"kind": "medusa", **asdict(drafter.config)}
    raise ValueError(f"unsupported drafter type {type(drafter).__name__}")


def build_drafter(config: dict, source: str = "drafter.json") -> torch.nn.Module:
    kind = config.get("kind")
    if kind == "eagle":
        return EagleDrafter(EagleConfig(LMConfig(**config["layer"])))
    if kind == "eagle3":
        return Eagle3Drafter(Eagle3Config.from_dict(config))
    if kind == "medusa":
        return MedusaDrafter(MedusaConfig(config["hidden_size"], config["vocab_size"], config["num_heads"]))
    raise ValueError(f"{source}: unknown drafter kind {kind!r}; expected 'eagle', 'eagle3' or 'medusa'")


def save_drafter(drafter: torch.nn.Module, path: str | os.PathLike, extra: dict | None = None) -> Path:
    with atomic_output_dir(path, overwrite=True) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / "drafter.safetensors"))
        (tmp / "drafter.json").write_text(json.dumps({**drafter_config_dict(drafter), **(extra or {})}, indent=2))
    return Path(path)


def check_weights(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], folder: os.PathLike,
                  config_name: str) -> None:
    """``state`` has exactly ``expected``'s names and shapes; errors name the folder and tensor."""
    if set(state) != set(expected):
        raise ValueError(f"{folder}: weights do not match {config_name}: missing "
                         f"{sorted(set(expected) - set(state))[:5]}, unexpected {sorted(set(state) - set(expected))[:5]}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, {config_name} implies "
                             f"{tuple(expected[name].shape)}")


def load_drafter(path: str | os.PathLike, target: DecoderLM | None = None, *,
                 device: torch.device | str | None = None) -> torch.nn.Module:
    """The drafter saved at `path`, in the dtype it was saved in, on `device` (None: the
    target's device, or the CPU without a target)."""
    folder = Path(path)
    cfg_path = folder / "drafter.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no drafter.json in the drafter folder")
    drafter = build_drafter(json.loads(cfg_path.read_text()), str(cfg_path))
    state = load_file(str(folder / "drafter.safetensors"))
    check_weights(state, drafter.state_dict(), folder, "drafter.json")
    drafter.load_state_dict(state)
    if device is None:
        device = target.lm_head_weight.device if target is not None else "cpu"
    drafter.to(device)
    if target is not None:
        drafter.check_target(target)
    return drafter.eval()
