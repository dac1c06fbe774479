"""Save and load drafters: `drafter.json` (kind + config) beside `drafter.safetensors`.

Only the drafter's own parameters are stored; the embedding and LM head belong to
the target. Loading checks the weights against the config and, when a target is
given, the config against the target, with errors that name the file and tensor.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.atomic import atomic_output_dir
from nemo_tlt.drafter.kinds import kind_named, kind_of
from nemo_tlt.model.lm import DecoderLM


def drafter_config_dict(drafter: torch.nn.Module) -> dict:
    """``drafter.json``'s contents: ``kind``, then what the kind saves (`nemo_tlt.drafter.kinds`)."""
    return {"kind": drafter.kind, **kind_of(drafter).config_dict(drafter)}


def drafter_from_config(config: dict, source: str = "drafter.json") -> torch.nn.Module:
    """An untrained drafter of the kind and shape ``config`` (a ``drafter.json`` dict) names."""
    kind = config.get("kind")
    if not isinstance(kind, str):
        raise ValueError(f"{source}: 'kind' must name a drafter kind, got {kind!r}")
    return kind_named(kind, source)(config)


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
    drafter = drafter_from_config(json.loads(cfg_path.read_text()), str(cfg_path))
    state = load_file(str(folder / "drafter.safetensors"))
    check_weights(state, drafter.state_dict(), folder, "drafter.json")
    drafter.load_state_dict(state)
    if device is None:
        device = target.lm_head_weight.device if target is not None else "cpu"
    drafter.to(device)
    if target is not None:
        drafter.check_target(target)
    return drafter.eval()
