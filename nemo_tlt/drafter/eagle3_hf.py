"""EAGLE-3 drafters <-> the EAGLE-3 HF checkpoint layout (the deployment export).

The layout is the one of the EAGLE-3 checkpoints SafeAILab publishes and vLLM,
SGLang and TensorRT-LLM's PyTorch backend load, followed from vLLM's
``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``, the
``LlamaForCausalLMEagle3`` architecture, 2025-26 main):

* ``config.json``: a Llama config of the draft layer (``num_hidden_layers: 1``,
  the target's ``vocab_size``) with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config:
  {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}``. vLLM numbers an
  aux layer by the decoder layer whose *input* it is, so a capture of layer i's
  output (our and TensorRT-LLM's ``eagle3_layers_to_capture`` convention) is written
  as i + 1. Our own fields (capture layers as we number them, TTT settings) are kept
  under ``nemo_tlt`` so the folder reads back exactly.
* ``model.safetensors``: ``fc.weight`` [H, k*H], ``midlayer.{input_layernorm,
  hidden_norm, post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight``
  [*, 2H], ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` [draft_vocab_size, H], and, only when the draft
  vocabulary is smaller than the target's (``draft_vocab_size < vocab_size``), ``d2t``
  (int64 [draft_vocab_size], target id = draft id + d2t) and ``t2d`` (bool [vocab_size]).
  A full-vocabulary drafter's maps are the identity and are not written; reading such
  a folder back rebuilds them. No ``embed_tokens.weight``: the loaders take the
  target's embedding when the checkpoint has none, as our drafter does. These are the
  drafter's own state-dict names, so export is a rename-free write.

  vLLM (0.32, ``Eagle3LlamaForCausalLM``) takes ``draft_vocab_size`` from config.json
  (``vocab_size`` when absent) and creates its ``draft_id_to_target_id`` parameter
  (int64, zeros) only when that differs from the target model's vocabulary size.
  ``load_weights`` skips ``t2d`` always and loads ``d2t`` into
  ``draft_id_to_target_id``; a ``d2t`` in a checkpoint whose draft vocabulary equals
  the target's therefore fails the load ("There is no module or parameter named
  'draft_id_to_target_id' in Eagle3LlamaForCausalLM"), while a smaller draft
  vocabulary without ``d2t`` loads and keeps the zeros (the first draft_vocab_size
  target ids), so the maps must be written exactly when the vocabulary is smaller.

Serving engines choose the captured layers themselves, distinct and in ascending
order (so a drafter capturing others is not exported): vLLM and SGLang read
``eagle_aux_hidden_state_layer_ids``; TensorRT-LLM's ``Eagle3DecodingConfig`` takes
``eagle3_layers_to_capture`` from the user (our numbering; its default equals ours
for targets deeper than 5 layers). None of these loaders runs here.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter, default_capture_layers
from nemo_tlt.drafter.io import check_weights
from nemo_tlt.model.config import LMConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_hf_config(drafter: Eagle3Drafter, dtype: torch.dtype) -> dict:
    c = drafter.config
    hf = c.layer.to_hf_config()
    hf.update(architectures=[ARCHITECTURE], num_hidden_layers=1, draft_vocab_size=c.draft_vocab_size,
              target_hidden_size=c.layer.hidden_size, tie_word_embeddings=False,
              torch_dtype=str(dtype).removeprefix("torch."),
              eagle_config={"eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.capture_layers],
                            "use_aux_hidden_state": True},
              nemo_tlt={"capture_layers": list(c.capture_layers), "ttt_steps": c.ttt_steps,
                        "ttt_decay": c.ttt_decay})
    return hf


def exported_capture_layers(folder: str | os.PathLike) -> tuple[int, ...]:
    """The target layers the drafter of an EAGLE-3 HF ``folder`` reads, in its order, in our
    0-based numbering (the config's ``eagle_aux_hidden_state_layer_ids`` minus one); a folder
    without them is a ValueError naming its config."""
    path = Path(folder) / "config.json"
    try:
        ids = json.loads(path.read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return tuple(int(i) - 1 for i in ids)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not an EAGLE-3 HF config with eagle_config.eagle_aux_hidden_state_layer_ids "
                         f"({err}); write one with `nemo-tlt convert --from drafter --to eagle3-hf`") from err


def eagle3_hf_state(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `drafter`'s EAGLE-3 HF export, detached on the host (float ones cast to
    `dtype` if given). ``d2t`` / ``t2d`` are kept only for a draft vocabulary smaller than the
    target's. A drafter whose capture layers are not distinct and ascending is refused: the
    serving engines capture a set of layers and hand them over in ascending order, so they
    would feed it other inputs than it was trained on."""
    layers = list(drafter.capture_layers)
    if layers != sorted(set(layers)):
        raise ValueError(f"write_eagle3_hf: the drafter captures target layers {layers}; vLLM, SGLang and "
                         "TensorRT-LLM hand captured layers over distinct and ascending, so no serving engine "
                         "would feed it what it was trained on (train it with Eagle3Config.capture_layers "
                         f"{sorted(set(layers))} on a target of at least {len(layers)} layers)")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if not drafter.config.draft_vocab_size < drafter.config.layer.vocab_size:
        # the identity maps of a full vocabulary: vLLM refuses a d2t it has no parameter for
        del state["d2t"], state["t2d"]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def write_eagle3_hf(drafter: Eagle3Drafter, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write `drafter`'s export (`eagle3_hf_state`) into the existing `folder`."""
    state = eagle3_hf_state(drafter, dtype)
    folder = Path(folder)
    (folder / "config.json").write_text(json.dumps(eagle3_hf_config(drafter, state["fc.weight"].dtype), indent=2))
    save_file(state, str(folder / "model.safetensors"))


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # SafeAILab's own checkpoints ship the .bin


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The first of WEIGHT_FILES present; a .bin is unpickled with tensors and containers only."""
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path))
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise ValueError(f"{path}: not a plain tensor dict ({err})") from None
    raise FileNotFoundError(f"{folder}: no weights (looked for {list(WEIGHT_FILES)})")


def _capture_layers(hf: dict, cfg_path: Path, target_num_layers: int | None) -> tuple[int, ...]:
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(i - 1 for i in ids)
    if target_num_layers is None:
        raise ValueError(f"{cfg_path}: no eagle_config.eagle_aux_hidden_state_layer_ids: the captured target "
                         "layers are not recorded (SafeAILab's checkpoints leave them to the serving engine's "
                         "default); give the target (--target MODEL_DIR) to use that default")
    # vLLM's default (2, L//2, L-3) in its numbering is TensorRT-LLM's and ours
    return default_capture_layers(target_num_layers)


def read_eagle3_hf(folder: str | os.PathLike, target_num_layers: int | None = None) -> Eagle3Drafter:
    """An EAGLE-3 HF folder -> the drafter, every tensor name and shape checked; weights
    keep the file's dtype. A target embedding in the file is not read (ours is shared).
    A full draft vocabulary needs no ``d2t`` / ``t2d`` maps (as `write_eagle3_hf` writes
    it): the drafter's identity maps are used; folders that carry them (earlier exports)
    read too. A smaller draft vocabulary without them is refused.

    Folders as SafeAILab publishes them read too: weights in ``pytorch_model.bin`` and
    no ``eagle_config`` (the captured layers are then the serving engines' default for
    a target of ``target_num_layers`` layers)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no config.json in the EAGLE-3 folder")
    hf = json.loads(cfg_path.read_text())
    if ARCHITECTURE not in (hf.get("architectures") or []):
        raise ValueError(f"{cfg_path}: architectures={hf.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    layer = LMConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]}, str(cfg_path))
    if hf.get("target_hidden_size") not in (None, layer.hidden_size):
        raise ValueError(f"{cfg_path}: target_hidden_size {hf['target_hidden_size']} differs from hidden_size "
                         f"{layer.hidden_size}; a drafter narrower than its target is not supported")
    ours = hf.get("nemo_tlt")
    if ours is not None:
        capture, ttt = tuple(ours["capture_layers"]), {"ttt_steps": ours["ttt_steps"], "ttt_decay": ours["ttt_decay"]}
    else:
        capture, ttt = _capture_layers(hf, cfg_path, target_num_layers), {}
    config = Eagle3Config(layer, capture, hf.get("draft_vocab_size") or layer.vocab_size, **ttt)
    state = _read_weights(folder)
    state.pop("embed_tokens.weight", None)
    drafter = Eagle3Drafter(config)
    if config.draft_vocab_size == layer.vocab_size:
        for name in ("d2t", "t2d"):  # the identity maps the drafter starts with
            state.setdefault(name, getattr(drafter, name))
    check_weights(state, drafter.state_dict(), folder, "config.json")
    drafter.to(state["fc.weight"].dtype)
    drafter.load_state_dict(state)
    return drafter.eval()
