"""Read legacy Megatron checkpoints (``--ckpt-format torch``): ``mp_rank_XX[_YYY]/model_optim_rng.pt``.

Contract: ``read_legacy_shards(folder, trust_pickle=False)`` finds the rank folders (``mp_rank_{tp:02d}``
without PP, ``mp_rank_{tp:02d}_{pp:03d}`` with PP) directly in ``folder`` or in
the iteration named by ``latest_checkpointed_iteration.txt``, loads each file's
``model`` entry (a megatron-core GPTModel state dict) and returns
``({(pp, tp): shard}, ParallelLayout)``. ``legacy_to_canonical`` converts them
with an ``LMConfig`` (legacy checkpoints only record the padded vocabulary, so
the model config must come from the caller, e.g. an HF ``config.json``).
Uneven pipeline stages are recovered from the layer counts found in the files.

Files are unpickled by ``megatron_pickle.load_megatron_pickle``: only what
Megatron-LM stores in them (its argparse namespace, RNG states, megatron-core
enums) is allowed, anything else is refused with an error naming the file, the
global and ``--trust-pickle``; ``trust_pickle=True`` uses full pickle, which runs
any code a file carries: only for checkpoints you trust.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import StateDict, megatron_to_canonical, split_layer_keys
from nemo_tlt.weights.megatron_pickle import load_megatron_pickle

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def _iteration_dir(folder: Path) -> Path:
    tracker = folder / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return folder
    text = tracker.read_text().strip()
    return folder / ("release" if text == "release" else f"iter_{int(text):07d}")


def read_legacy_shards(folder: str | os.PathLike, trust_pickle: bool = False
                       ) -> tuple[dict[tuple[int, int], StateDict], ParallelLayout]:
    root = _iteration_dir(Path(folder))
    found: dict[tuple[int, int], Path] = {}
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        m = _RANK_DIR.match(entry.name)
        if m and (entry / "model_optim_rng.pt").is_file():
            found[(int(m.group(2) or 0), int(m.group(1)))] = entry / "model_optim_rng.pt"
    if not found:
        raise FileNotFoundError(f"{root}: no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    pp = 1 + max(p for p, _ in found)
    tp = 1 + max(t for _, t in found)
    missing = sorted({(p, t) for p in range(pp) for t in range(tp)} - set(found))
    if missing:
        raise ValueError(f"{root}: rank folders missing for (pp, tp) {missing}")
    shards: dict[tuple[int, int], StateDict] = {}
    for coords, path in found.items():
        blob = load_megatron_pickle(path, trust_pickle=trust_pickle)
        if "model" not in blob:
            raise ValueError(f"{path}: no 'model' entry (is this a Megatron checkpoint?)")
        shards[coords] = {k: v for k, v in blob["model"].items() if isinstance(v, torch.Tensor)}
    counts = [len(split_layer_keys(shards[(p, 0)])[0]) for p in range(pp)]
    return shards, _layout_for(counts, tp, root)


def _layout_for(counts: list[int], tp: int, root: Path) -> ParallelLayout:
    """The megatron layout (even, or uneven first / last stage) that yields these stage sizes."""
    pp = len(counts)
    candidates = [(None, None)]
    if pp > 1:
        candidates += [(counts[0], None), (None, counts[-1]), (counts[0], counts[-1])]
    for first, last in candidates:
        layout = ParallelLayout(tp=tp, pp=pp, num_layers_in_first_stage=first, num_layers_in_last_stage=last)
        try:
            if layout.stage_layer_counts(sum(counts)) == counts:
                return layout
        except ValueError:
            continue  # this candidate cannot split the layers; try the next
    raise ValueError(f"{root}: pipeline stages hold {counts} layers, which megatron cannot produce")


def legacy_to_canonical(folder: str | os.PathLike, cfg: LMConfig, trust_pickle: bool = False) -> StateDict:
    shards, layout = read_legacy_shards(folder, trust_pickle=trust_pickle)
    return megatron_to_canonical(shards, cfg, layout)
