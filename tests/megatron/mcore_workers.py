"""Worker functions run inside gloo processes by the megatron tests (forked by tests/ranks.py).

One world runs every case in sequence and returns small picklable results; the test
process does the asserting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.dist import RankContext


@dataclass(frozen=True)
class Case:
    name: str
    cfg: LMConfig
    layout: ParallelLayout
    rollout_tps: tuple[int, ...] = ()
    tokens: torch.Tensor | None = None  # None: the session's shared tokens


def perturb_norms(model, cfg: LMConfig, layout: ParallelLayout) -> None:
    """Norms start at ones, which would hide a swapped norm; give them values keyed by the global
    layer so every TP rank of a stage agrees (norms are replicated)."""
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    offset = layout.stage_layer_offsets(cfg.num_layers)[stage]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" not in name:
                continue
            parts = name.split(".")
            key = offset + int(parts[2]) if parts[1] == "layers" else 10_000
            g = torch.Generator().manual_seed(key * 7 + ("pre_mlp" in name))
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


def _to_rank0(value, world: int):
    box = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(value, box, dst=0)
    return box


def run_case(case: Case, tokens: torch.Tensor, world: int) -> dict | None:
    """Megatron logits, captured hidden states, gathered canonical weights and reshard results."""
    from megatron.core import parallel_state
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.gpt_builder import build_gpt_model
    from megatron_patches.hidden_capture import HiddenCapture, LayerCapture
    from nemo_tlt.megatron.pipeline_forward import forward_logits
    from nemo_tlt.megatron.live import gather_canonical, local_shard, rank_coords
    from nemo_tlt.weights.reshard import ReshardPlan, gather_reshard, groups_created, stream_reshard

    if case.tokens is not None:
        tokens = case.tokens
    init_model_parallel(case.layout.tp, case.layout.pp, seed=1234)
    model = build_gpt_model(case.cfg, case.layout)
    perturb_norms(model, case.cfg, case.layout)
    captured: list[torch.Tensor] = []
    layer_outputs: dict[int, torch.Tensor] = {}
    with HiddenCapture(model, captured.append) as cap, \
            LayerCapture(model, range(case.cfg.num_layers), layer_outputs.__setitem__) as taps:
        logits = forward_logits(model, tokens)
        active = cap.active
    layers = _to_rank0((rank_coords(), taps.owned, layer_outputs), world)
    canonical = gather_canonical(model, case.cfg, case.layout)
    shards = _to_rank0((rank_coords(), local_shard(model)), world)
    reshard = {}
    for rtp in case.rollout_tps:
        plan = ReshardPlan(case.cfg, case.layout, rtp)
        streamed = stream_reshard(local_shard(model), plan)
        groups = groups_created()
        again = stream_reshard(local_shard(model), plan)  # as after every RL step: no new groups
        assert groups_created() == groups and (streamed is None) == (again is None)
        if streamed is not None:
            assert all(torch.equal(streamed[k], again[k]) for k in streamed)
        gathered = gather_reshard(local_shard(model), ReshardPlan(case.cfg, case.layout, rtp))
        reshard[rtp] = _to_rank0((streamed, gathered), world)
    box = _to_rank0((logits, captured, active), world)
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    last = [b for b in box if b[0] is not None]
    return {"logits": last[0][0], "hidden": last[0][1], "active": [b[2] for b in box],
            "canonical": canonical, "reshard": reshard, "shards": dict(shards), "layers": layers}


def session(ctx: RankContext, cases: list[Case], tokens: torch.Tensor) -> dict | None:
    rank, world = ctx.rank, ctx.world
    from megatron_patches.cpu_shims import cpu_shims

    results = {}
    with cpu_shims():
        for case in cases:
            results[case.name] = run_case(case, tokens, world)
    return results if rank == 0 else None


def torch_dist_roundtrip(canonical: dict, cfg: LMConfig, save_layout: ParallelLayout, ckpt_dir: str) -> dict | None:
    """canonical -> torch_dist written at ``save_layout`` -> loaded back at TP=PP=1 on every rank."""
    from megatron.core import parallel_state
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.torch_dist import load_torch_dist, save_torch_dist

    init_model_parallel(save_layout.tp, save_layout.pp)
    save_torch_dist(canonical, cfg, save_layout, ckpt_dir)
    parallel_state.destroy_model_parallel()
    dist.barrier()
    init_model_parallel(1, 1)
    loaded_cfg, loaded = load_torch_dist(ckpt_dir, ParallelLayout())
    parallel_state.destroy_model_parallel()
    return {"cfg": loaded_cfg, "canonical": loaded} if dist.get_rank() == 0 else None
