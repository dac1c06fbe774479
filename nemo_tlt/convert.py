"""``nemo-tlt convert``: checkpoint conversion between HF folders, Megatron torch_dist and TensorRT-LLM.

Contract: ``main(argv) -> int`` (also ``tools/convert_checkpoint.py``). Supported:

* ``--from hf --to torch_dist --tp T --pp P``: a gloo world of T*P CPU processes
  builds the GPTModel shards and megatron's ``dist_checkpointing`` writes them;
  the processes are started with the GPU hidden (``nemo_tlt.dist.launch_local``), so this works
  on GPU hosts as on CPU-only ones;
* ``--from torch_dist --to hf``: loaded by megatron at TP=PP=1 (megatron reshards
  on load), written as ``config.json`` + ``model.safetensors``; checkpoints from
  other tools need ``--hf-config`` (a config.json describing the model);
* ``--from legacy --to hf --hf-config config.json``: legacy ``mp_rank_XX[_YYY]``
  Megatron checkpoints (TP/PP read from the folder names), unpickled with only
  what Megatron-LM stores allowed; ``--trust-pickle`` lifts that for files you trust;
* ``--from hf --to trtllm --tp T``: TensorRT-LLM checkpoint folder;
* ``--from drafter --to eagle3-hf``: a saved EAGLE-3 drafter (``drafter.json``) in
  the EAGLE-3 HF checkpoint layout vLLM, SGLang and TensorRT-LLM load
  (nemo_tlt.drafter.eagle3_hf); ``--from eagle3-hf --to drafter`` reads one back, or a
  published one (``--target MODEL_DIR`` when its config does not record the captured layers).

Errors are clear and early (unknown architecture, mismatched tensor shapes, a TP
that does not divide heads / kv groups / MLP width, a model the Megatron routes
cannot hold exactly: an o_proj bias, or llama3 rope scaling megatron-core lacks);
an existing output is refused without ``--overwrite``; output is written to a temp
folder and renamed, so a failed conversion leaves nothing behind. Exit code 0 on
success, 2 on a usage or input error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from nemo_tlt.model.config import LMConfig
from nemo_tlt.atomic import atomic_output_dir
from nemo_tlt.dist import RankContext, launch_local
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import check_megatron_biases, check_tp

_ROUTES = {("hf", "torch_dist"), ("torch_dist", "hf"), ("legacy", "hf"), ("hf", "trtllm"),
           ("drafter", "eagle3-hf"), ("eagle3-hf", "drafter")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", required=True, choices=["hf", "torch_dist", "legacy", "drafter", "eagle3-hf"])
    p.add_argument("--to", dest="dst", required=True, choices=["hf", "torch_dist", "trtllm", "drafter", "eagle3-hf"])
    p.add_argument("--input", required=True, help="input folder")
    p.add_argument("--output", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="target tensor parallel size (torch_dist, trtllm)")
    p.add_argument("--pp", type=int, default=1, help="target pipeline parallel size (torch_dist)")
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="layers on the first pipeline stage (uneven PP; torch_dist)")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="layers on the last pipeline stage (uneven PP; torch_dist)")
    p.add_argument("--hf-config", default=None,
                   help="config.json describing the model (legacy checkpoints; torch_dist ones of other tools)")
    p.add_argument("--target", default=None,
                   help="eagle3-hf: the target model folder; its layer count gives the captured layers when the "
                        "checkpoint does not record them (as SafeAILab's do), and the drafter is checked against it")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast the weights written (default: keep their dtype)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-pickle", action="store_true",
                   help="legacy: unpickle the .pt files with full pickle (can run code in them); "
                        "only for files you trust that hold more than Megatron-LM stores")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit for the gloo worker processes")
    return p


def read_hf_canonical(folder: str | os.PathLike, dtype: torch.dtype | None = None) -> tuple[LMConfig, dict]:
    """An HF folder -> (config, canonical state dict), every tensor name and shape checked."""
    from nemo_tlt.model.hf_io import read_config, read_state_dict
    from nemo_tlt.model.lm import DecoderLM

    cfg = read_config(folder)
    state = read_state_dict(folder)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in DecoderLM(cfg).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(state[name].shape)}, "
                             f"config.json implies {tuple(shape)}")
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return cfg, state


def write_hf(canonical: dict, cfg: LMConfig, folder: Path) -> None:
    hf = cfg.to_hf_config()
    hf["torch_dtype"] = str(next(iter(canonical.values())).dtype).removeprefix("torch.")
    with open(folder / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
    save_file({k: v.contiguous() for k, v in canonical.items()}, str(folder / "model.safetensors"))


def _save_worker(ctx: RankContext, hf_dir: str, dtype: torch.dtype | None, layout: ParallelLayout,
                 out: str) -> None:
    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.torch_dist import save_torch_dist

    # Each rank reads the HF folder itself: shipping the weights through the spawn pipe
    # would pickle the whole model once per rank.
    cfg, canonical = read_hf_canonical(hf_dir, dtype)
    with cpu_shims():
        init_model_parallel(layout.tp, layout.pp)
        save_torch_dist(canonical, cfg, layout, out)


def _load_worker(ctx: RankContext, ckpt: str, cfg: LMConfig | None, dtype: torch.dtype | None,
                 out: str) -> None:
    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.torch_dist import load_torch_dist

    with cpu_shims():
        init_model_parallel(1, 1)
        loaded_cfg, canonical = load_torch_dist(ckpt, ParallelLayout(), cfg)
        write_hf(_cast(canonical, dtype), loaded_cfg, Path(out))


def _cast(state: dict, dtype: torch.dtype | None) -> dict:
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}


def _hf_config(path: str | None) -> LMConfig:
    if path is None:
        raise ValueError("--hf-config is required: this checkpoint does not record the full model config")
    with open(path) as f:
        return LMConfig.from_hf_config(json.load(f), source=path)


def convert(args: argparse.Namespace) -> None:
    if (args.src, args.dst) not in _ROUTES:
        raise ValueError(f"conversion {args.src} -> {args.dst} is not supported; supported: {sorted(_ROUTES)}")
    if "torch_dist" in (args.src, args.dst):
        from nemo_tlt.megatron import require_megatron_core

        require_megatron_core(f"nemo-tlt convert --from {args.src} --to {args.dst}")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if "drafter" in (args.src, args.dst):
        return _convert_drafter(args, dtype)
    steps = tqdm(total=3, desc=f"convert {args.src}->{args.dst}", unit="step")
    if args.src == "hf":
        cfg, canonical = read_hf_canonical(args.input, dtype)
        steps.update()
        if args.dst == "torch_dist":
            layout = ParallelLayout(tp=args.tp, pp=args.pp, num_layers_in_first_stage=args.first_stage_layers,
                                    num_layers_in_last_stage=args.last_stage_layers)
            from nemo_tlt.megatron.gpt_builder import check_megatron_model

            check_megatron_model(cfg)
            check_tp(cfg, layout.tp)
            layout.stage_layer_counts(cfg.num_layers)
        else:
            from nemo_tlt.weights.rollout import check_rollout_tp

            check_rollout_tp(cfg, args.tp)
    elif not os.path.isdir(args.input):
        raise FileNotFoundError(f"{args.input}: not a directory")
    # torch_dist work runs on CPU processes joined by gloo, whatever the machine: launch_local
    # hides any GPU from them, so megatron's CPU shims run there on GPU hosts too.

    with atomic_output_dir(args.output, overwrite=args.overwrite) as tmp:
        if args.dst == "trtllm":
            from nemo_tlt.weights.trtllm import canonical_to_trtllm, write_trtllm_files

            write_trtllm_files(*canonical_to_trtllm(canonical, cfg, args.tp), tmp)
        elif args.dst == "torch_dist":
            launch_local(_save_worker, layout.tp * layout.pp, args.input, dtype, layout, str(tmp),
                     timeout_s=args.timeout_s)
        elif args.src == "legacy":
            from nemo_tlt.weights.legacy import legacy_to_canonical

            hf_cfg = _hf_config(args.hf_config)
            check_megatron_biases(hf_cfg)
            canonical = legacy_to_canonical(args.input, hf_cfg, trust_pickle=args.trust_pickle)
            write_hf(_cast(canonical, dtype), hf_cfg, tmp)
        else:
            hf_cfg = _hf_config(args.hf_config) if args.hf_config else None
            if hf_cfg is not None:
                from nemo_tlt.megatron.gpt_builder import check_megatron_model

                check_megatron_model(hf_cfg)
            launch_local(_load_worker, 1, args.input, hf_cfg, dtype, str(tmp), timeout_s=args.timeout_s)
        steps.update()
    steps.update()
    steps.close()


def _convert_drafter(args: argparse.Namespace, dtype: torch.dtype | None) -> None:
    from nemo_tlt.drafter.eagle3 import Eagle3Drafter
    from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf, write_eagle3_hf
    from nemo_tlt.drafter.io import load_drafter, save_drafter
    from nemo_tlt.model.hf_io import read_config
    from nemo_tlt.model.lm import DecoderLM

    if args.src == "drafter":
        drafter = load_drafter(args.input)
        if not isinstance(drafter, Eagle3Drafter):
            raise ValueError(f"{args.input}: drafter kind {drafter.kind!r} has no EAGLE-3 HF layout; "
                             "only kind 'eagle3' drafters export to eagle3-hf")
        with atomic_output_dir(args.output, overwrite=args.overwrite) as tmp:
            write_eagle3_hf(drafter, tmp, dtype)
    else:
        target = read_config(args.target) if args.target is not None else None
        drafter = read_eagle3_hf(args.input, target.num_layers if target is not None else None)
        if target is not None:
            with torch.device("meta"):
                drafter.check_target(DecoderLM(target))
        if dtype is not None:
            drafter.to(dtype)
        if os.path.exists(args.output) and not args.overwrite:
            raise FileExistsError(f"{args.output} exists; pass --overwrite to replace it")
        save_drafter(drafter, args.output)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as err:
        print(f"nemo-tlt convert: error: {err}", file=sys.stderr)
        return 2
    print(f"nemo-tlt convert: wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
