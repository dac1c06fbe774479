"""``nemo-tlt bench checkpoint``: each rank's peak extra host memory while it writes its shard of a
sharded policy checkpoint (megatron backend, TP2 x PP2 on 4 gloo CPU ranks).

Contract: ``main(argv) -> int`` runs trials, each a fresh world of 4 CPU processes (gloo; GPU
hidden). In a trial every rank builds its ``MegatronPolicy`` shard (bf16 weights by default,
random values from ``RandomSource``, no file read), takes one GRPO update (so megatron's
distributed optimizer holds its fp32 main params and Adam moments), then all ranks save
together by one method:

* ``sharded``: ``MegatronPolicy.save_sharded`` (megatron-core ``dist_checkpointing.save``,
  torch_dist format: what the sharded run checkpoint writes);
* ``async``: ``MegatronPolicy.start_save_sharded`` then its ``wait()`` at once (megatron-core's
  async save, what the sharded run checkpoint uses, with nothing run during the write);
* ``control``: ``torch.save`` of the same live tensors this rank owns (its bf16 weights, the
  fp32 main-param shards, the Adam moments), written storage by storage without a copy: the
  memory of writing the shard from where it lies, which checks the measure itself;
* ``async_update``: ``start_save_sharded``, then the same GRPO update again (log-probs and
  update, same batch), then ``wait()``: the run checkpoint's case, where the policy's next
  updates run while the forked writers still write (``nemo_tlt.rl.state.sharded_run_checkpoint``);
* ``update_alone``: that update with no save in flight, the second control;
* ``async_step``: ``start_save_sharded``, then the update's optimizer step again at once
  (``MegatronPolicy._optimizer_step``: gradients finalised, Adam step, weights copied from the
  main params, on the gradients the update left), then ``wait()``: the step as an update
  takes it, which first waits for the writers (``finish_writes``), so its rewrite of the state
  never overlaps the write;
* ``step_alone``: that step with no save in flight;
* ``async_touch``: ``start_save_sharded``, then every element of the rank's own tensors (bf16
  weights, fp32 main params, both moments) rewritten in place with its own value
  (``mul_(1)``, far faster than the write), then ``wait()``: every page a step rewrites,
  rewritten while what is left of the write runs (``start_save_sharded`` itself takes most
  of a save's time on the CPU): what the policy's wait prevents, reported as the unguarded
  case and not part of the target;
* ``touch_alone``: that rewrite with no save in flight.

What is measured: the kernel's peak resident set of the rank's process (``VmHWM``, reset
through ``/proc/self/clear_refs`` just before the method) minus the resident set at that
moment (as ``nemo-tlt bench load``), plus the peak of the anonymous memory only its
descendants map (``nemo_tlt.bench.tree_memory.ChildrenPeak``, sampled every 10 ms):
megatron-core writes the files from a forked process that forks 2 writers, and keeps a
results-queue server process; a forked writer shares the rank's pages, so only the pages it
adds count, and every page the rank rewrites while a writer lives is copied, the old page
staying with the writers. Page cache of the written files is not in it.
"Own shard" is the bytes of the ``__<rank>_*.distcp`` files the rank wrote in the ``sharded``
save (every tensor it is the main replica of: weights, fp32 main params, both moments; at
DP=1 all of its TP x PP slice). "One layer" is one whole decoder layer's state, unsliced:
its parameters x (weights dtype + 3 fp32 values: main param, two moments). The target, per
rank: the ``sharded`` and ``async`` peaks, and the write in flight during an update or a step
(the ``async_*`` peak minus its ``*_alone`` peak, medians), each <= own shard + one layer.
Trials alternate the order; medians are reported. Fresh processes per trial: memory a method
frees may stay in the allocator and would hide the next method's peak.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from nemo_tlt.bench.common import add_model_shape, add_start_method, megatron_bench_refusal, model_config, write_summary
import torch.distributed as dist

from nemo_tlt.bench.load import _DTYPES, _reset_peak, _status
from nemo_tlt.bench.tree_memory import ChildrenPeak
from nemo_tlt.dist import RankContext, launch_local
from nemo_tlt.model.config import LMConfig

METHODS = ("sharded", "async", "control", "async_update", "update_alone", "async_step", "step_alone",
           "async_touch", "touch_alone")
IN_FLIGHT = {"update": ("async_update", "update_alone"), "step": ("async_step", "step_alone"),
             "touch": ("async_touch", "touch_alone")}
TARGET_WORK = ("update", "step")  # what a run does while the writers live; "touch" is the unguarded bound


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    add_model_shape(p, hidden=1536, layers=16, heads=12, kv_heads=4, ffn=4096)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weights dtype")
    p.add_argument("--trials", type=int, default=2, help="trials per method (the order alternates)")
    add_start_method(p)
    p.add_argument("--timeout-s", type=float, default=900.0)
    return p


class RandomSource:
    """A ``CanonicalSource`` of random values (norms 1), generated slice by slice: nothing is read or kept."""

    def __init__(self, cfg: LMConfig) -> None:
        from nemo_tlt.weights.sources import expected_shapes

        self._shapes = expected_shapes(cfg)
        self.label, self.bytes_read = "random weights", 0

    def names(self) -> frozenset[str]:
        return frozenset(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name])

    def read(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        shape = list(self._shapes[name])
        shape[dim] = stop - start
        if "norm" in name:
            return torch.ones(shape, dtype=dtype)
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{dim}:{start}".encode()))
        return (0.02 * torch.randn(shape, generator=g)).to(dtype)


def _own_tensors(policy) -> dict:
    """The live tensors this rank owns: weights, fp32 main-param shards, Adam moments (no copies)."""
    from nemo_tlt.megatron.ddp_optimizer import _main_shards, distributed_optimizers

    out = {"weights": [p.data for p in policy.model.parameters()], "main": [], "moments": []}
    for opt in distributed_optimizers(policy.optimizer):
        out["main"] += [m.data for m in _main_shards(opt)]
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                out["moments"] += [state["exp_avg"], state["exp_avg_sq"]]
    return out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def view_bytes(policy) -> int:
    """Bytes of the tensors this rank writes that are views into a larger storage (the DDP param
    buffer's weights): megatron-core's ``FileSystemWriterAsync`` clones each such CPU tensor before
    writing it (``_clone_if_needed``), so these bytes are copied during the save."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    total = 0
    for value in nested_values(policy._sharded_state(False)):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            t = value.data
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                total += t.numel() * t.element_size()
    return total


def _one_update(policy, rank: int) -> None:
    g = torch.Generator().manual_seed(7)
    vocab = policy.model_config.vocab_size
    batch = [(torch.randint(3, vocab, (8,), generator=g).tolist(), torch.randint(3, vocab, (24,), generator=g).tolist())
             for _ in range(2)]
    advantages = torch.tensor([1.0, -1.0])
    old, ref = policy.logprobs(batch)
    policy.update(batch, advantages, old, ref, sum(len(r) for _, r in batch))


def _worker(ctx: RankContext, method: str, cfg: LMConfig, dtype: torch.dtype, folder: str) -> dict:
    from nemo_tlt.device import Placement
    from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend

    config = PolicyConfig(backend="megatron", tensor_parallel=2, pipeline_parallel=2, micro_batch=2,
                          optim=PolicyOptimConfig(lr=1e-4))
    policy = build_policy_backend(config, RandomSource(cfg), cfg, temperature=1.0, seed=1,
                                  placement=Placement.cpu(dtype))
    _one_update(policy, ctx.rank)
    own = _own_tensors(policy)
    views = view_bytes(policy)
    target = Path(folder) / method
    gc.collect()
    dist.barrier()
    _reset_peak()
    base = _status("VmRSS")
    start = time.perf_counter()
    with ChildrenPeak() as children:
        during = _run_method(method, policy, target, own, ctx.rank, start)
    wall = time.perf_counter() - start
    peak = _status("VmHWM") - base
    dist.barrier()
    written = sum(f.stat().st_size for f in target.glob(f"__{ctx.rank}_*.distcp"))
    return {"coords": list(policy.coords), "wall_s": wall, "rank_extra_bytes": peak,
            "children_bytes": children.figure, "children_measure": children.measure,
            "children_pss_bytes": children.peak, "children_private_bytes": children.private_peak,
            "samples": children.samples, "dropped": children.dropped,
            "writers_end_s": writers_end_s(children.live), "most_children": max((n for _, n in children.live), default=0),
            "policy_step": policy.step, "peak_extra_bytes": peak + children.figure, "written_bytes": written,
            "view_bytes": views, "live": {k: _bytes(v) for k, v in own.items()}, **during}


def _run_method(method: str, policy, target: Path, own: dict, rank: int, start: float) -> dict:
    """Run one method; for those that update, when the update (or step) ended, in seconds
    since ``start``."""
    pending = None
    if method == "sharded":
        policy.save_sharded(str(target))
    elif method == "async":
        policy.start_save_sharded(str(target)).wait()
    elif method == "control":
        target.mkdir(parents=True, exist_ok=True)
        torch.save(own, target / f"rank{rank}.pt")
    elif any(method in pair for pair in IN_FLIGHT.values()):
        work = next(k for k, pair in IN_FLIGHT.items() if method in pair)
        if method == IN_FLIGHT[work][0]:
            pending = policy.start_save_sharded(str(target))
        if work == "update":
            _one_update(policy, rank)
        elif work == "step":
            policy._optimizer_step()  # as in an update: waits for the writers first
        else:
            for tensors in own.values():
                for t in tensors:
                    t.mul_(1)
        ended = time.perf_counter() - start
        if pending is not None:
            pending.wait()
        return {"update_end_s": ended}
    else:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    return {}


def writers_end_s(live: list[tuple[float, int]]) -> float | None:
    """When megatron's writers last ended (seconds since the start), from ``ChildrenPeak.live``:
    during a write the rank has 4 live descendants (the results server, the forked writer and
    its 2 writers), after it 2 (or 1)."""
    ends = [t for (_, before), (t, now) in zip(live, live[1:]) if before >= 3 > now]
    return ends[-1] if ends else None


# ---- the parent -----------------------------------------------------------------

def layer_state_bytes(cfg: LMConfig, dtype: torch.dtype) -> int:
    """One whole decoder layer's parameters x (weights dtype + fp32 main param + two fp32 moments)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_heads), \
        cfg.num_kv_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_heads)
    params = 2 * h + 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size
    return params * (torch.empty((), dtype=dtype).element_size() + 12)


def _order(trials: int) -> list[str]:
    order = []
    for i in range(trials):
        order += list(METHODS) if i % 2 == 0 else list(reversed(METHODS))
    return order


def _median(rows: list[dict], key: str) -> int:
    return int(statistics.median(x[key] for x in rows))


def rank_summary(rows: dict[str, list[dict]], layer: int) -> dict:
    """One rank's figures from its trials (``rows``: method -> that rank's result per trial):
    medians per method, and the write in flight during an update and during a step (the peak
    with the write in flight minus the peak of the same work alone, ``IN_FLIGHT``), against
    the budget (own shard + ``layer``). Per trial: when the update / step ended and when the
    writers ended (seconds since the start), to see whether they overlapped."""
    first = rows["sharded"][0]
    shard = first["written_bytes"]
    budget = shard + layer
    peak = {m: _median(rows[m], "peak_extra_bytes") for m in METHODS}
    in_flight = {k: peak[during] - peak[alone] for k, (during, alone) in IN_FLIGHT.items()}
    parts = {m: {k: _median(rows[m], k)
                 for k in ("rank_extra_bytes", "children_bytes", "children_pss_bytes", "children_private_bytes")}
             for m in METHODS}
    timed = [m for pair in IN_FLIGHT.values() for m in pair]
    return {
        "coords": first["coords"], "own_shard_bytes": shard, "live_bytes": first["live"],
        "cloned_view_bytes": first["view_bytes"], "budget_bytes": budget, "peak_extra_bytes": peak,
        "peak_parts": parts, "write_in_flight_extra_bytes": in_flight,
        # pss_anon; private where the rank shares pages with a live parent (forked ranks: tree_memory)
        "children_measure": sorted({x["children_measure"] for m in METHODS for x in rows[m]}),
        "peak_over_shard": {m: round(peak[m] / shard, 3) for m in METHODS},
        "peak_over_budget": {m: round(peak[m] / budget, 3) for m in METHODS},
        "in_flight_over_shard": {k: round(v / shard, 3) for k, v in in_flight.items()},
        "in_flight_over_budget": {k: round(v / budget, 3) for k, v in in_flight.items()},
        "wall_s": {m: round(statistics.median(x["wall_s"] for x in rows[m]), 2) for m in METHODS},
        "update_end_s": {m: [round(x["update_end_s"], 2) for x in rows[m]] for m in timed},
        "writers_end_s": {m: [x["writers_end_s"] for x in rows[m]] for m in METHODS if m.startswith("async")},
        "policy_step": {m: rows[m][0]["policy_step"] for m in METHODS},  # updates taken by the end
        "samples": {m: _median(rows[m], "samples") for m in METHODS},
        "most_children": {m: max(x["most_children"] for x in rows[m]) for m in METHODS},  # live at once
        "samples_dropped": {m: _median(rows[m], "dropped") for m in METHODS},
        "save_within_target": max(peak["sharded"], peak["async"]) <= budget,
        "in_flight_within_target": max(in_flight[k] for k in TARGET_WORK) <= budget,
    }


def summarise(runs: list[tuple[str, list[dict]]], cfg: LMConfig, dtype: torch.dtype, params: int) -> dict:
    layer = layer_state_bytes(cfg, dtype)
    per_rank = [rank_summary({m: [ranks[r] for name, ranks in runs if name == m] for m in METHODS}, layer)
                for r in range(len(runs[0][1]))]
    save_ok = all(r["save_within_target"] for r in per_rank)
    in_flight_ok = all(r["in_flight_within_target"] for r in per_rank)
    return {"layout": "TP2xPP2", "params": params, "dtype": str(dtype).replace("torch.", ""),
            "layer_state_bytes": layer, "order": [name for name, _ in runs], "per_rank": per_rank,
            "save_within_target": save_ok, "in_flight_within_target": in_flight_ok,
            "within_target": save_ok and in_flight_ok,
            "measure": "the rank's VmHWM - VmRSS at the start of the method (reset via /proc/self/clear_refs) "
                       "+ the sampled (10 ms) peak of the anonymous memory only its descendants map "
                       "(children_pss_bytes; for ranks forked from a live parent, whose shares make it "
                       "meaningless, children_private_bytes: their private resident bytes); fresh "
                       "processes per trial; all ranks run the method at once; write in flight = "
                       "async_update - update_alone, async_step - step_alone, async_touch - touch_alone (medians); "
                       f"the target covers {', '.join(TARGET_WORK)} (touch: the rewrite the policy's wait prevents)"}


def main(argv: list[str] | None = None) -> int:
    from nemo_tlt.weights.sources import expected_shapes

    args = _parser().parse_args(argv)
    refusal = megatron_bench_refusal("checkpoint", args.trials)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype]
    cfg = model_config(args)
    params = sum(torch.Size(s).numel() for s in expected_shapes(cfg).values())
    runs = []
    for method in _order(args.trials):
        with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as folder:
            runs.append((method, launch_local(_worker, 4, method, cfg, dtype, folder, timeout_s=args.timeout_s,
                                              collective_timeout_s=args.timeout_s, start_method=args.start_method)))
    summary = summarise(runs, cfg, dtype, params)
    return write_summary(summary, args.out, summary["within_target"])


if __name__ == "__main__":
    sys.exit(main())
