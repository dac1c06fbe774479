"""Worker functions for tests/policy/test_megatron_backend.py, run inside gloo processes (forked by tests/ranks.py).

One world runs several cases in sequence; each returns small picklable results to rank 0
and the test process does the asserting against the torch backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nemo_tlt.model.config import LMConfig
from nemo_tlt.dist import RankContext
from nemo_tlt.policy import PolicyConfig, build_policy_backend


@dataclass(frozen=True)
class PolicyCase:
    name: str
    cfg: LMConfig
    canonical: dict
    policy: PolicyConfig
    batch: list            # [(prompt, response)] of the whole step
    advantages: torch.Tensor
    # data-parallel split: rank r of the DP group takes batch[i] for i in shards[r]; () = whole batch
    shards: tuple[tuple[int, ...], ...] = field(default=())
    engine_hidden: list | None = None  # the torch rollout engine's harvested hidden states of `batch`
    # an EAGLE-3 drafter's layers: the first update's forward hands on_hidden their features
    capture_layers: tuple[int, ...] | None = None
    engine_features: list | None = None  # the engine's harvest of `batch` with that drafter loaded
    # rollout.training_state=offload: a second policy takes the same two steps, offloaded and
    # reloaded between them, and must end bit for bit where the first one does
    offload: bool = False


def _gather(value, world: int):
    box = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(value, box, dst=0)
    return box


def run_case(case: PolicyCase, world: int) -> dict | None:
    from megatron.core import parallel_state

    trainer = build_policy_backend(case.policy, case.canonical, case.cfg, temperature=1.0, seed=1234)
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = case.shards[dp_rank] if case.shards else tuple(range(len(case.batch)))
    batch = [case.batch[i] for i in mine]
    hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    old, ref = trainer.logprobs(batch, on_hidden=lambda i, tok, h: hidden.__setitem__(mine[i], (tok, h)))
    global_tokens = sum(len(r) for _, r in case.batch)
    features: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    stats = trainer.update(batch, case.advantages[list(mine)], old, ref, global_tokens,
                           on_hidden=(lambda i, tok, h: features.__setitem__(mine[i], (tok, h)))
                           if case.capture_layers else None, capture_layers=case.capture_layers)
    canonical = trainer.canonical_state_dict()
    rollout = dict(trainer.canonical_weights())
    # the slice-only sync of a rollout replica of 2 ranks (on 2-rank worlds): this rank's slices only
    rollout_slices = dict(trainer.canonical_weights(rollout_tp=2)) if world == 2 else None
    # a second step with the old log-probs taken from the loss forward itself (logp_old=None)
    stats_on_policy = trainer.update(batch, case.advantages[list(mine)], None, ref, global_tokens)
    canonical_on_policy = trainer.canonical_state_dict()
    moved = (_offloaded_twin(case, batch, case.advantages[list(mine)], (old, ref), global_tokens,
                             (stats, stats_on_policy), trainer.state_dict()) if case.offload else None)
    local = {"coords": trainer.coords, "dp": dp_rank, "offload": moved and moved[1], "ids": mine, "old": old, "ref": ref, "stats": stats,
             "hidden": hidden, "features": features, "rollout": rollout, "rollout_slices": rollout_slices,
             "norms": {k: v.clone() for k, v in trainer.model.state_dict().items() if "layernorm.weight" in k},
             "opt_state_keys": sorted(trainer.state_dict()),
             "train_ranks": trainer.train_ranks, "sharded_state": trainer.sharded_state,
             # what megatron-core was built with (the policy keys must reach its TransformerConfig)
             "mcore": {"sequence_parallel": trainer.model.config.sequence_parallel,
                       "recompute_granularity": trainer.model.config.recompute_granularity}}
    everyone = _gather(local, world)
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    return {"canonical": canonical, "canonical_on_policy": canonical_on_policy, "ranks": everyone,
            "canonical_offloaded": moved and moved[0]}


def _training_state(policy) -> dict[str, list[torch.Tensor]]:
    """Every tensor of a megatron policy's training state, by kind."""
    from nemo_tlt.megatron.ddp_optimizer import distributed_optimizers

    opts = distributed_optimizers(policy.optimizer)
    return {"weights": list(policy.model.parameters()),
            "param_buffers": [b.param_data for b in policy.ddp.buffers],
            "grad_buffers": [b.grad_data for b in policy.ddp.buffers],
            "main_grads": [p.main_grad for p in policy.model.parameters()],
            "optimizer": [v for o in opts for st in o.optimizer.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor)],
            "main_params": [p for o in opts for g in o.optimizer.param_groups for p in g["params"]],
            "reference": list(policy.reference.parameters()) if policy.reference is not None else []}


def _offload_round_trip(policy) -> dict:
    """Offload and reload (no KL reference here): the kinds whose storage was not released, and
    whether every tensor (bf16: the fp32 main params are tensors of their own) came back bit for bit."""
    state = {k: v for k, v in _training_state(policy).items() if k != "reference"}
    before = {k: [t.clone() for t in ts] for k, ts in state.items()}
    policy.offload_training_state()
    kept = sorted(k for k, ts in state.items() if not ts or any(t.untyped_storage().nbytes() for t in ts))
    policy.reload_training_state()
    same = all(_same(before[k], v) for k, v in state.items() if "grad" not in k)
    return {"kept": kept, "same": same, "grads_zero": all(not t.any() for k in ("grad_buffers", "main_grads")
                                                          for t in state[k])}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _offloaded_twin(case: PolicyCase, batch: list, advantages: torch.Tensor, logprobs: tuple, global_tokens: int,
                    stats: tuple[dict, dict], state: dict) -> tuple[dict | None, dict]:
    """The two steps again on a second policy, offloaded and reloaded in between: (its gathered
    canonical weights, on rank 0; this rank's findings: the state's kinds whose storage was not
    released, whether the stats and the optimizer shard equal the first policy's bit for bit)."""
    twin = build_policy_backend(case.policy, case.canonical, case.cfg, temperature=1.0, seed=1234)
    first = twin.update(batch, advantages, *logprobs, global_tokens)
    twin.offload_training_state()
    kept = sorted(kind for kind, tensors in _training_state(twin).items()
                  if not tensors or any(t.untyped_storage().nbytes() for t in tensors))
    twin.reload_training_state()
    second = twin.update(batch, advantages, None, logprobs[1], global_tokens)
    return twin.canonical_state_dict(), {"kept": kept, "stats": _same((first, second), stats),
                                         "state": _same(twin.state_dict(), state)}


def session(ctx: RankContext, cases: list[PolicyCase]) -> dict | None:
    results = {case.name: run_case(case, ctx.world) for case in cases}
    return results if ctx.rank == 0 else None


def bf16_update(ctx: RankContext, cfg: LMConfig, canonical: dict, policy: PolicyConfig, batch: list,
                advantages: torch.Tensor) -> dict | None:
    """One update of a bf16 megatron policy (fp32 masters); rank 0 returns what the test compares."""
    from megatron.core import parallel_state

    from nemo_tlt.device import Placement

    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234,
                                   placement=Placement.cpu(torch.bfloat16))
    stats = trainer.update(batch, advantages, None, None, sum(len(r) for _, r in batch))
    from nemo_tlt.megatron.ddp_optimizer import distributed_optimizers

    opts = distributed_optimizers(trainer.optimizer)
    # the distributed optimizer's own shards: fp32 main params and the bf16 weights' slices they round to
    mains = [m for o in opts for g in o.shard_fp32_from_float16_groups for m in g]
    shards = [p for o in opts for g in o.shard_float16_groups for p in g]
    local = {"param_dtypes": sorted({str(p.dtype) for p in trainer.params}),
             "optimizers": sorted(type(o).__name__ for o in opts),
             "master_dtypes": sorted({str(m.dtype) for m in mains}),
             "state_dtypes": sorted({str(v.dtype) for o in opts for s in o.optimizer.state.values()
                                     for k, v in s.items() if k != "step"}),
             "params_are_rounded_masters": bool(mains) and all(torch.equal(p, m.to(p.dtype))
                                                               for p, m in zip(shards, mains))}
    local["offload"] = _offload_round_trip(trainer)
    weights = trainer.canonical_state_dict()
    masters = _canonical_masters(trainer, opts)
    everyone = _gather(local, ctx.world)
    parallel_state.destroy_model_parallel()
    return {"stats": stats, "weights": weights, "masters": masters, "ranks": everyone} if ctx.rank == 0 else None


def _canonical_masters(trainer, opts) -> dict | None:
    """The distributed optimizer's fp32 main params, gathered in canonical names on rank 0 (as
    ``gather_canonical`` gathers the bf16 weights): the step as the optimizer took it, before the
    rounding to bf16 hides a part of it."""
    from nemo_tlt.megatron.live import local_shard, rank_coords
    from nemo_tlt.weights.megatron_layout import megatron_to_canonical

    main_of = {}
    for o in opts:
        for params, mains in [*zip(o.model_float16_groups, o.shard_fp32_from_float16_groups),
                              *zip(o.model_fp32_groups, o.shard_fp32_groups)]:
            for p, m in zip(params, mains, strict=True):
                # data-parallel size 1: this rank's shard of each of its parameters is the whole parameter
                assert m.numel() == p.numel(), (tuple(p.shape), m.numel())
                main_of[p] = m.detach().float().reshape(p.shape).clone()
    shard = local_shard(trainer.model)
    named = dict(trainer.model.named_parameters())
    assert set(named) <= set(shard) and len(main_of) == len(named), (sorted(named), len(main_of))
    shard.update({name: main_of[p] for name, p in named.items()})
    everything = _gather((rank_coords(), shard), dist.get_world_size())
    if everything is None:
        return None
    return megatron_to_canonical(dict(everything), trainer.model_config, trainer.layout)
