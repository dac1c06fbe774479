"""``nemo-tlt bench load``: each rank's peak host memory while it builds its TP2 x PP2 policy shard
from an HF folder, per-rank lazy loader vs today's whole-model path.

Contract: ``main(argv) -> int`` writes a random Llama-shaped HF folder with transformers'
``save_pretrained`` (about 1.03B parameters by default, sharded with an index; ``--folder``
reuses or keeps one), then runs trials, each a fresh world of 4 CPU processes (gloo; GPU
hidden). In a trial every rank builds its megatron-core ``GPTModel`` shard and loads its
weights by one method, the ranks taking turns (so one rank loads at a time):

* ``whole`` (today): ``load_hf_folder`` (the whole model, fp32, as the RL loop loads it) ->
  ``canonical_to_megatron`` (every rank's shards) -> a randomly initialised GPTModel ->
  ``load_shard`` of this rank's shard cast to the weights dtype;
* ``lazy``: an uninitialised GPTModel filled tensor by tensor from
  ``SafetensorsFolder`` (``nemo_tlt.weights.megatron_source``): own slices only;
* ``control``: an uninitialised GPTModel whose weights are only zero-filled: the
  memory of holding the shard and nothing else, which checks the measure itself.

What is measured: the kernel's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the load) minus the resident set at that moment
(``VmRSS``; the process with torch, megatron-core and its process groups already in
it). It counts every page the process touched: anonymous memory and the pages of the
safetensors files mapped while they are read, so it is an upper bound of the memory the
load needs, not an allocator's estimate. Fresh processes per trial: memory a method frees
may stay in the allocator and would hide the next method's peak. The target: each rank's
``lazy`` peak <= its own shard's bytes + 2 decoder layers' bytes (whole layer, weights
dtype). Trials alternate the order (whole, lazy, control, then reversed); medians are
reported. ``bit_exact``: ``whole`` and ``lazy`` leave every rank identical weights.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from nemo_tlt.bench.common import add_model_shape, add_start_method, megatron_bench_refusal, write_summary
import torch.distributed as dist

from nemo_tlt.dist import RankContext, launch_local
from nemo_tlt.weights.layout import ParallelLayout

METHODS = ("whole", "lazy", "control")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--folder", default=None, help="HF folder to use (written there first if it has no config.json)")
    add_model_shape(p, hidden=2048, layers=20, heads=16, kv_heads=4, ffn=5632)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="stored and weights dtype")
    p.add_argument("--trials", type=int, default=2, help="trials per method (the order alternates)")
    add_start_method(p)
    p.add_argument("--timeout-s", type=float, default=1200.0)
    return p


def write_folder(folder: str, args: argparse.Namespace) -> None:
    """A random Llama-shaped folder saved by transformers (the format real checkpoints have)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=_DTYPES[args.dtype])
    model.save_pretrained(folder, max_shard_size="1GB")


# ---- inside a rank --------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load(method: str, folder: str, cfg, layout: ParallelLayout, dtype: torch.dtype, coords) -> torch.nn.Module:
    from nemo_tlt.megatron.gpt_builder import build_gpt_model
    from nemo_tlt.megatron.live import load_shard, load_shard_items

    if method == "whole":
        from nemo_tlt.model.hf_io import load_hf_folder
        from nemo_tlt.weights.megatron_layout import canonical_to_megatron

        canonical = load_hf_folder(folder).state_dict()
        shard = canonical_to_megatron(canonical, cfg, layout)[coords]
        model = build_gpt_model(cfg, layout, dtype=dtype)
        load_shard(model, {k: v.to(dtype) for k, v in shard.items()})
        return model
    model = build_gpt_model(cfg, layout, dtype=dtype, initialize=False)
    if method == "lazy":
        from nemo_tlt.weights.hf_source import SafetensorsFolder
        from nemo_tlt.weights.megatron_source import megatron_shard_items

        load_shard_items(model, megatron_shard_items(SafetensorsFolder(folder), cfg, layout, coords, dtype), "local")
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def _digest(model: torch.nn.Module) -> str:
    from nemo_tlt.megatron.live import local_shard

    h = hashlib.sha256()
    for name, t in sorted(local_shard(model).items()):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _worker(ctx: RankContext, method: str, folder: str, layout: ParallelLayout, dtype: torch.dtype) -> dict:
    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.live import local_shard, rank_coords
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.model.hf_io import read_config

    import nemo_tlt.megatron.gpt_builder  # noqa: F401  every method's imports precede the baseline
    import nemo_tlt.weights.hf_source  # noqa: F401
    import nemo_tlt.weights.megatron_source  # noqa: F401

    cfg = read_config(folder)
    with cpu_shims():
        init_model_parallel(layout.tp, layout.pp)
        coords = rank_coords()
        out = {}
        for turn in range(ctx.world):
            dist.barrier()
            if turn != ctx.rank:
                continue
            _reset_peak()
            base = _status("VmRSS")
            start = time.perf_counter()
            model = _load(method, folder, cfg, layout, dtype, coords)
            out = {"coords": list(coords), "wall_s": time.perf_counter() - start,
                   "peak_extra_bytes": _status("VmHWM") - base,
                   "shard_bytes": sum(t.numel() * t.element_size() for t in local_shard(model).values()),
                   "digest": _digest(model)}
            del model
        dist.barrier()
    return out


# ---- the parent -----------------------------------------------------------------

def _layer_bytes(cfg, dtype: torch.dtype) -> int:
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return torch.empty((), dtype=dtype).element_size() * (2 * h + 2 * h * q + 2 * h * kv
                                                          + 3 * h * cfg.intermediate_size)


def _order(trials: int) -> list[str]:
    order = []
    for i in range(trials):
        order += list(METHODS) if i % 2 == 0 else list(reversed(METHODS))
    return order


def summarise(runs: list[tuple[str, list[dict]]], cfg, dtype: torch.dtype, params: int) -> dict:
    layer = _layer_bytes(cfg, dtype)
    world = len(runs[0][1])
    per_rank = []
    for r in range(world):
        rows = {m: [ranks[r] for name, ranks in runs if name == m] for m in METHODS}
        shard = rows["lazy"][0]["shard_bytes"]
        budget = shard + 2 * layer
        peak = {m: int(statistics.median(x["peak_extra_bytes"] for x in rows[m])) for m in METHODS}
        per_rank.append({
            "coords": rows["lazy"][0]["coords"], "shard_bytes": shard, "budget_bytes": budget,
            "peak_extra_bytes": peak,
            "peak_over_budget": {m: round(peak[m] / budget, 3) for m in METHODS},
            "whole_over_lazy": round(peak["whole"] / peak["lazy"], 2),
            "wall_s": {m: round(statistics.median(x["wall_s"] for x in rows[m]), 2) for m in METHODS},
            "within_target": peak["lazy"] <= budget,
            "bit_exact": len({x["digest"] for m in ("whole", "lazy") for x in rows[m]}) == 1,
        })
    return {"layout": "TP2xPP2", "params": params, "dtype": str(dtype).replace("torch.", ""),
            "layer_bytes": layer, "order": [name for name, _ in runs], "per_rank": per_rank,
            "within_target": all(r["within_target"] for r in per_rank),
            "bit_exact": all(r["bit_exact"] for r in per_rank),
            "measure": "VmHWM - VmRSS at the start of the load (reset via /proc/self/clear_refs); fresh "
                       "processes per trial; ranks load in turn"}


def _check_memory(model_bytes_fp32: int) -> None:
    """The whole path holds the fp32 model about 2.5 times over on one rank: refuse when the host lacks it."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    need = int(2.7 * model_bytes_fp32)
    if available < need:
        raise RuntimeError(f"bench load: the whole-model path needs about {need / 2**30:.1f} GiB on the loading "
                           f"rank; {available / 2**30:.1f} GiB available. Use a smaller model (--layers, --hidden)")


def main(argv: list[str] | None = None) -> int:
    from nemo_tlt.model.hf_io import read_config

    args = _parser().parse_args(argv)
    refusal = megatron_bench_refusal("load", args.trials)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype]
    temp = None if args.folder else tempfile.mkdtemp(prefix="bench_load_")
    folder = args.folder or temp
    try:
        t0 = time.perf_counter()
        if not os.path.isfile(os.path.join(folder, "config.json")):
            write_folder(folder, args)
        write_s = time.perf_counter() - t0
        cfg = read_config(folder)
        from nemo_tlt.weights.sources import expected_shapes

        params = sum(torch.Size(s).numel() for s in expected_shapes(cfg).values())
        layout = ParallelLayout(tp=2, pp=2)
        runs = []
        for method in _order(args.trials):
            if method == "whole":
                _check_memory(4 * params)
            runs.append((method, launch_local(_worker, 4, method, folder, layout, dtype, timeout_s=args.timeout_s,
                                              collective_timeout_s=args.timeout_s, start_method=args.start_method)))
        summary = {**summarise(runs, cfg, dtype, params), "folder_write_s": round(write_s, 1)}
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return write_summary(summary, args.out, summary["bit_exact"] and summary["within_target"])


if __name__ == "__main__":
    sys.exit(main())
