"""``nemo-tlt bench reshard``: streaming reshard vs gather-everything, TP2 x PP2 -> rollout TP1 / TP2.

Contract: ``main(argv) -> int`` runs 4 CPU processes (gloo; started with the GPU
hidden, so it runs on GPU hosts too), gives every rank a
random fp32 Megatron shard of a Llama-shaped model (about 1.03B parameters by
default), then for each rollout TP size runs ``stream_reshard`` and
``gather_reshard`` to the first ``tp`` ranks and writes a JSON file with:

* ``peak_extra_bytes_per_rank``: ``{"streaming", "gather"}``, the largest
  transient byte count on any rank (counted tensor by tensor by the reshard
  code's ``ByteMeter``: receive buffers and conversion copies; the rollout
  weights being built are the output, not extra), worst case over targets;
* ``largest_layer_bytes``: bytes of one transformer layer (the target is a
  streaming peak <= 2 of these);
* ``wall_s``: ``{"streaming", "gather"}`` summed over targets (slowest rank);
* ``bit_exact``: every rollout tensor identical between the two paths (digests);
* ``model_bytes``: the canonical model's bytes (fp32);
* ``by_target``: the same numbers per rollout TP size, and for each: ``rollout_tp``,
  ``bytes_received_per_rank`` (list by global rank, the streaming reshard's, as its
  ``ByteMeter`` counted them; ``gather_bytes_received_per_rank`` the reference's),
  ``planned_bytes_received_per_rank`` (``nemo-tlt plan``'s accounting,
  ``nemo_tlt.plan.reshard_plan``, for the same layout and receivers),
  ``received_over_slice`` (max received x rollout_tp / model_bytes; target <= 1.1) and
  ``within_target``; top-level ``within_target`` is all of them.

``--receivers first`` (default) makes the first ``tp`` ranks the receivers; ``all``
makes every rank one (a colocated rollout engine per rank, as in the RL loop).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch

from nemo_tlt.bench.common import add_model_shape, add_start_method, megatron_bench_refusal, model_config, write_summary
import torch.distributed as dist

from nemo_tlt.dist import RankContext, launch_local
from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt bench reshard", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    add_model_shape(p, hidden=2048, layers=20, heads=16, kv_heads=4, ffn=5632)
    p.add_argument("--rollout-tps", default="1,2", help="comma-separated rollout TP sizes")
    p.add_argument("--receivers", choices=("first", "all"), default="first",
                   help="first: the first TP ranks receive; all: every rank does")
    add_start_method(p)
    p.add_argument("--timeout-s", type=float, default=900.0)
    return p


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.blake2b(v.contiguous().numpy().data, digest_size=16).hexdigest() for k, v in state.items()}


def _timed(fn, *args) -> tuple[dict | None, float]:
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args)
    dist.barrier()
    return out, time.perf_counter() - start


def _receivers(rtp: int, mode: str, world: int) -> tuple[int, ...]:
    return tuple(range(rtp)) if mode == "first" else tuple(range(world))


def _worker(ctx: RankContext, cfg: LMConfig, layout: ParallelLayout, rollout_tps: list[int], mode: str) -> dict:
    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.live import rank_coords
    from nemo_tlt.weights.reshard import ByteMeter, ReshardPlan, gather_reshard, megatron_shard_shapes, stream_reshard

    with cpu_shims():
        init_model_parallel(layout.tp, layout.pp)
        coords = rank_coords()
        g = torch.Generator().manual_seed(1000 * coords[0] + coords[1])
        shapes = megatron_shard_shapes(cfg, layout)[coords]
        shard = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
        report = {}
        for rtp in rollout_tps:
            receivers = _receivers(rtp, mode, ctx.world)
            stream_plan = ReshardPlan(cfg, layout, rtp, receivers, meter=ByteMeter())
            out, stream_s = _timed(stream_reshard, shard, stream_plan)
            stream_digest = _digests(out) if out is not None else None
            del out
            gather_plan = ReshardPlan(cfg, layout, rtp, receivers, meter=ByteMeter())
            out, gather_s = _timed(gather_reshard, shard, gather_plan)
            same = out is None or _digests(out) == stream_digest
            del out
            report[rtp] = {"streaming_peak": stream_plan.meter.peak, "gather_peak": gather_plan.meter.peak,
                           "streaming_s": stream_s, "gather_s": gather_s, "bit_exact": same,
                           "streaming_received": stream_plan.meter.received,
                           "gather_received": gather_plan.meter.received}
    return report


def _summarise(cfg: LMConfig, layout: ParallelLayout, per_rank: list[dict], rollout_tps: list[int],
               mode: str) -> dict:
    from nemo_tlt.plan.reshard_plan import plan_stream_reshard

    layer_bytes = 4 * (2 * cfg.hidden_size + 2 * cfg.hidden_size * cfg.num_heads * cfg.head_dim
                       + 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
                       + 3 * cfg.hidden_size * cfg.intermediate_size)
    params = (cfg.num_layers * layer_bytes // 4 + 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size)
    model_bytes = 4 * params
    by_target = {}
    for rtp in rollout_tps:
        rows = [r[rtp] for r in per_rank]
        received = [r["streaming_received"] for r in rows]
        planned = plan_stream_reshard(cfg, layout, 1, rtp, _receivers(rtp, mode, len(per_rank)), dtype_bytes=4)
        by_target[f"tp{rtp}"] = {
            "rollout_tp": rtp,
            "bytes_received_per_rank": received,
            "gather_bytes_received_per_rank": [r["gather_received"] for r in rows],
            "planned_bytes_received_per_rank": planned.bytes_received_per_rank,
            "received_over_slice": round(max(received) * rtp / model_bytes, 4),
            "within_target": max(received) <= 1.1 * model_bytes / rtp,
            "peak_extra_bytes_per_rank": {"streaming": max(r["streaming_peak"] for r in rows),
                                          "gather": max(r["gather_peak"] for r in rows)},
            "wall_s": {"streaming": max(r["streaming_s"] for r in rows),
                       "gather": max(r["gather_s"] for r in rows)},
            "bit_exact": all(r["bit_exact"] for r in rows),
        }
    targets = by_target.values()
    return {
        "source_layout": "TP2xPP2",
        "params": params,
        "model_bytes": model_bytes,
        "receivers": mode,
        "dtype": "float32",
        "peak_extra_bytes_per_rank": {k: max(t["peak_extra_bytes_per_rank"][k] for t in targets)
                                      for k in ("streaming", "gather")},
        "largest_layer_bytes": layer_bytes,
        "embedding_bytes": 4 * cfg.vocab_size * cfg.hidden_size,
        "wall_s": {k: round(sum(t["wall_s"][k] for t in targets), 3) for k in ("streaming", "gather")},
        "bit_exact": all(t["bit_exact"] for t in targets),
        "within_target": all(t["within_target"] for t in targets),
        "by_target": by_target,
        "memory_counting": "transient tensor bytes counted by nemo_tlt.weights.reshard.ByteMeter",
    }


def main(argv: list[str] | None = None) -> int:

    args = _parser().parse_args(argv)
    refusal = megatron_bench_refusal("reshard")
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    rollout_tps = [int(x) for x in args.rollout_tps.split(",")]
    cfg = model_config(args)
    layout = ParallelLayout(tp=2, pp=2)
    per_rank = launch_local(_worker, 4, cfg, layout, rollout_tps, args.receivers, timeout_s=args.timeout_s,
                            start_method=args.start_method)
    summary = _summarise(cfg, layout, per_rank, rollout_tps, args.receivers)
    return write_summary(summary, args.out, summary["bit_exact"] and summary["within_target"])


if __name__ == "__main__":
    sys.exit(main())
