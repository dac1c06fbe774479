"""``nemo-tlt bench memory``: the plan's memory per rank and phase of an RL step against the
tracked memory of the same step run on CPU ranks (gloo), under two layouts.

Contract: ``main(argv) -> int``. For each layout (``LAYOUTS``: policy TP2 with rollout TP1 on 2
ranks; policy TP2 x PP2 with rollout TP2 on 4 ranks) a fresh world of CPU processes runs two RL
steps of a random bf16 Llama-shaped model written as an HF folder: the megatron policy
(``policy.backend=megatron``, distributed optimizer, fp32 main grads, no recompute, no sequence
parallelism) and the embedded torch engine at the rollout TP, colocated on every rank, with
the policy's training state resident during the rollout (``rollout.training_state=resident``).
A step, in the RL loop's order: ``rollout`` (the replica's prompts, each ``--group`` times,
``coupled`` sampling, every row decoded to ``--max-new`` tokens: EOS does not stop, so the KV
cache reaches the plan's worst case), ``update`` (the whole step's rollouts, gathered, one
GRPO update: DP is 1), ``sync`` (the policy's canonical weights streamed into the engine at the
rollout TP) and ``checkpoint`` (``save_sharded``: megatron-core's torch_dist save). The first
step warms up (the optimizer's state is created by the first update); the second is measured
per phase with ``nemo_tlt.bench.tracked_memory.PhaseMemory`` (what it counts and what not: its
docstring).

The prediction: the planner's terms for the same model, layout and batch
(``nemo_tlt.plan.build.plan_shapes`` of a ``PlanConfig`` built from the same settings, SD off,
the layer spec the CPU ranks build: ``local``), with
the GPU allowances (``reserve_gib``, ``workspace_gib``) at 0, as there is no CUDA context on a
CPU rank, and the KV term at its worst case (every row at prompt + ``--max-new``), arranged per
rank and phase by ``nemo_tlt.plan.rank_memory``; compared by ``nemo_tlt.plan.memory_check``.
The target: every rank within 15% in every phase, on both layouts. Exit status 0 when met, 1
when not (the JSON is written either way), 2 on bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

from nemo_tlt.bench.common import (
    add_model_shape, add_start_method, format_table, machine_info, megatron_bench_refusal, model_config, write_summary,
)
from nemo_tlt.dist import RankContext, launch_local
from nemo_tlt.plan.rank_memory import PHASES

# name -> (world, policy TP, policy PP, rollout TP)
LAYOUTS = {"tp2_rollout_tp1": (2, 2, 1, 1), "tp2xpp2_rollout_tp2": (4, 2, 2, 2)}


@dataclasses.dataclass(frozen=True)
class Step:
    prompts: int
    group: int
    prompt_len: int
    max_new: int
    micro_batch: int


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    add_model_shape(p, hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=2048)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="sequences per prompt (grpo.group_size)")
    p.add_argument("--prompt-len", type=int, default=32)
    # 126: the engine's first cache holds the longest prompt + 128 slots, so the rows never grow it
    p.add_argument("--max-new", type=int, default=126, help="tokens decoded per row (grpo.max_new_tokens)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (policy.micro_batch)")
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--tolerance", type=float, default=0.15)
    add_start_method(p)
    p.add_argument("--timeout-s", type=float, default=900.0)
    return p


def _write_model(cfg, folder: Path) -> None:
    from nemo_tlt.model.hf_io import save_hf_folder
    from nemo_tlt.model.lm import DecoderLM

    torch.manual_seed(0)
    save_hf_folder(DecoderLM(cfg).to(torch.bfloat16), folder)


def _worker(ctx: RankContext, folder: str, layout: tuple[int, int, int, int], step: Step) -> dict:
    import torch.distributed as dist

    from nemo_tlt.bench.tracked_memory import PhaseMemory
    from nemo_tlt.device import Placement
    from nemo_tlt.model.hf_io import read_config
    from nemo_tlt.model.safetensors_folder import SafetensorsFolder
    from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend
    from nemo_tlt.rl.rollout_replicas import RolloutReplicas, rollout_tp_group
    from nemo_tlt.rollout.protocol import Request
    from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
    from nemo_tlt.speculative.sampling import SamplingParams

    _, tp, pp, rollout_tp = layout
    cfg = read_config(folder)
    config = PolicyConfig(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp, micro_batch=step.micro_batch,
                          optim=PolicyOptimConfig(lr=1e-4))
    policy = build_policy_backend(config, SafetensorsFolder(folder), cfg, temperature=1.0, seed=1,
                                  placement=Placement.cpu(torch.bfloat16))
    replicas = RolloutReplicas(ctx.rank, ctx.world, rollout_tp)
    engine = TorchRolloutEngine.from_hf_folder(folder, dtype=torch.bfloat16, tp=rollout_tp_group(replicas))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (step.prompt_len,), generator=g).tolist() for _ in range(step.prompts)]
    mine = replicas.prompts(step.prompts)
    requests = [Request(prompts[p], seq_id=p * step.group + i) for p in mine for i in range(step.group)]
    tracker = PhaseMemory()
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as ckpt:
        for n in range(2):
            measure = n == 1
            sampling = SamplingParams(mode="coupled", max_new_tokens=step.max_new, seed=n, stop_on_eos=False)
            with tracker.phase("rollout", measure):
                out = engine.generate(requests, sampling)
            rows = [(r.prompt, res.tokens) for r, res in zip(requests, out.results)]
            gathered: list = [None] * ctx.world
            dist.all_gather_object(gathered, rows)
            batch = [row for q in range(replicas.replicas) for row in gathered[q * rollout_tp]]
            advantages = torch.tensor([(-1.0) ** i for i in range(len(batch))])
            with tracker.phase("update", measure):
                policy.update(batch, advantages, None, None, sum(len(r) for _, r in batch))
            with tracker.phase("sync", measure):
                engine.load_policy_weights(policy.canonical_weights(rollout_tp))
            with tracker.phase("checkpoint", measure):
                policy.save_sharded(str(Path(ckpt) / f"step{n}"))
            dist.barrier()
    return {"rank": ctx.rank, "coords": list(policy.coords), "peaks": tracker.peaks, "parts": tracker.parts}


def predict(folder: str, layout: tuple[int, int, int, int], step: Step) -> dict[int, dict[str, dict[str, float]]]:
    """The planner's bytes per rank, phase and term for this benchmark's run (see the module docstring)."""
    from nemo_tlt.megatron.gpt_builder import layer_spec_name
    from nemo_tlt.model.hf_io import read_config
    from nemo_tlt.plan.build import plan_inputs, plan_shapes
    from nemo_tlt.plan.cluster import ClusterSpec
    from nemo_tlt.plan.config import BatchPlan, PlanConfig, RolloutPlan, SDPlan, TrainingPlan
    from nemo_tlt.plan.rank_memory import rank_phase_memory

    world, tp, pp, rollout_tp = layout
    plan = PlanConfig(model_config=folder, cluster=ClusterSpec(nodes=1, gpus_per_node=world),
                      training=TrainingPlan(tensor_parallel=tp, pipeline_parallel=pp, micro_batch=step.micro_batch,
                                            sequence_parallel=False, recompute="none", distributed_optimizer=True,
                                            grad_bytes=4, reserve_gib=0.0, layer_spec=layer_spec_name("cpu")),
                      rollout=RolloutPlan(tensor_parallel=rollout_tp, prompt_len=step.prompt_len, workspace_gib=0.0,
                                          training_state="all", reserve_gib=0.0),
                      batch=BatchPlan(prompts=step.prompts, group_size=step.group, max_response_len=step.max_new),
                      sd=SDPlan(enabled=False, drafter_training=False))
    cfg = read_config(folder)
    training, rollout = plan_shapes(cfg, plan, plan_inputs(plan).lengths)
    return rank_phase_memory(cfg, training, dataclasses.replace(rollout, kv_tokens=0))


def _table(name: str, comparison: dict) -> str:
    rows = {}
    for rank, phases in comparison["per_rank"].items():
        for phase in PHASES:
            c = phases[phase]
            rows[f"{name} r{rank} {phase}"] = {
                "plan_MiB": c["predicted_bytes"] / 2**20, "measured_MiB": c["measured_bytes"] / 2**20,
                "plan/measured": c["ratio"], "within": c["within"], "largest_term": c["largest_term"]}
    return format_table(rows, ["plan_MiB", "measured_MiB", "plan/measured", "within", "largest_term"])


def run_layout(name: str, args: argparse.Namespace, cfg, step: Step) -> dict:
    from nemo_tlt.plan.memory_check import compare_memory
    from nemo_tlt.plan.rank_memory import as_printed

    layout = LAYOUTS[name]
    with tempfile.TemporaryDirectory(prefix="bench_memory_model_") as folder:
        _write_model(cfg, Path(folder))
        ranks = launch_local(_worker, layout[0], folder, layout, step, timeout_s=args.timeout_s,
                             collective_timeout_s=args.timeout_s, start_method=args.start_method)
        predicted = predict(folder, layout, step)
    measured = {r["rank"]: r["peaks"] for r in ranks}
    comparison = compare_memory(predicted, measured, args.tolerance)
    printed = compare_memory({r: {ph: {"plan": as_printed(t, ph)} for ph, t in v.items()} for r, v in predicted.items()},
                             measured, args.tolerance)
    return {"world": layout[0], "policy_tp": layout[1], "policy_pp": layout[2], "rollout_tp": layout[3],
            "predicted_terms_bytes": predicted, "measured_parts": {r["rank"]: r["parts"] for r in ranks},
            "coords": {r["rank"]: r["coords"] for r in ranks}, "comparison": comparison,
            "plan_as_printed": {"per_phase": printed["per_phase"], "within_target": printed["within_target"]}}


def main(argv: list[str] | None = None) -> int:
    from nemo_tlt.plan.memory import parameter_count

    args = _parser().parse_args(argv)
    refusal = megatron_bench_refusal("memory")
    if refusal is None and not args.tolerance >= 0:
        refusal = f"--tolerance must be >= 0, got {args.tolerance}"
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    cfg = model_config(args, max_position_embeddings=max(512, args.prompt_len + args.max_new + 8))
    step = Step(args.prompts, args.group, args.prompt_len, args.max_new, args.micro_batch)
    layouts = {name: run_layout(name, args, cfg, step) for name in args.layouts}
    for name, result in layouts.items():
        print(_table(name, result["comparison"]))
    ok = all(r["comparison"]["within_target"] for r in layouts.values())
    summary = {"machine": machine_info(), "model": dataclasses.asdict(cfg), "parameters": parameter_count(cfg),
               "dtype": "bfloat16", "step": dataclasses.asdict(step), "tolerance": args.tolerance,
               "layouts": layouts, "within_target": ok,
               "measure": "tracked tensor memory (nemo_tlt.bench.tracked_memory): live tensor storages at the "
                          "phase's start + the peak running sum of the CPU allocator's events in the phase; "
                          "second of two steps; not counted: Python objects, allocator fragmentation and "
                          "cached blocks, forked writers' pages",
               "prediction": "nemo_tlt.plan.rank_memory per rank and phase, reserve and workspace allowances 0, "
                             "KV at its worst case; plan_as_printed: without the co-resident terms "
                             "nemo-tlt plan does not count in a phase"}
    return write_summary(summary, args.out, ok)


if __name__ == "__main__":
    sys.exit(main())
