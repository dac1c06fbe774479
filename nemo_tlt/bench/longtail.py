"""`nemo-tlt bench rollout --workload longtail`: adaptive SD on a long-tailed rollout.

One rollout = P prompts x G samples (coupled sampling by default, so every method must
emit the same tokens) whose lengths are long-tailed. Methods, same prompts and seeds:
`longtail_plain`; SD always on with each fixed arm (`longtail_fixed_<d>_<k>_<n>`);
`longtail_adaptive`: with `--policy learned` (default) plain decoding or a tree per
step, learned from step costs (nemo_tlt.adaptive.learned_policy); with
`--policy threshold` SD below a running-batch threshold and BEG-MAB picking the arm.
`longtail_adaptive` starts every round with a fresh policy: the cold case, an RL
run's first steps (`ratios`). `--warm` adds `longtail_adaptive_warm`: one policy kept
across the rounds, as the RL loop keeps it across steps, after `--warm-up` untimed
rollouts of its own (`ratios_warm`, same keys). `--drafter untrained` swaps the demo
drafter for a freshly initialised one (what a run starts with, or a drafter gone
stale). Methods run in round-robin rounds, each round starting one method later;
each reports its median round. `ratios_rounds` holds each round's own ratios
(methods of one round ran back to back) and `noise` the spread between rounds;
`ratios_cpu` / `ratios_warm_cpu` are the same ratios on each run's CPU time, with
`control` (`longtail_control`: the first arm run a second time every round, over its
first run: identical work) and a 90% bootstrap interval over rounds of each
(`ratios_cpu_interval`, `ratios_warm_cpu_interval`).
Writes JSON with the adaptive run's step trace and a timeline PNG beside it.

`--engine vllm` runs the same methods on one `VLLMRolloutEngine` (vLLM, imported only
then) built once with the shipped EAGLE-3 demo drafter (exported to the HF layout) over
the demo target and shared by every method: they differ only in the SD policy passed to
`generate` (None for `longtail_plain`). vLLM has no coupled sampling, so `--mode`
defaults to greedy there (lossless: every method emits the same tokens, which
`outputs_identical` checks; `coupled` is refused; the G samples of a prompt are then one
sequence decoded G times: P distinct lengths); vLLM's EAGLE-3 drafts chains, so the arms
must be chains `d_1_d` (default 4_1_4, 8_1_8, 12_1_12) and the engine drafts up to the
deepest; `--drafter untrained` loads a freshly initialised EAGLE-3 drafter of the same
shape into the running engine. `longtail_plain` runs on that engine (draft length 0),
whose plain steps still cost more than vLLM built without a drafter: `--plain-engine`
adds `longtail_plain_no_drafter`, plain decoding on a second engine built without one
(`adaptive_vs_plain_no_drafter`, `plain_vs_plain_no_drafter`). Before the rounds every
method decodes the warm-up prompts once, untimed (vLLM's first call runs slower: its
first prefill). The engine is left running at exit, with the default torch.distributed
group vLLM made (a bench process ends there).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import REWARDS, AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig
from nemo_tlt.drafter.eagle import EagleDrafter
from nemo_tlt.demo.assets import AssetConfig, default_cache_dir, load_assets, prepare_assets, task_requests
from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.bench.common import format_table, machine_info
from nemo_tlt.bench.headroom import bucket_seconds, per_bucket_oracle
from nemo_tlt.bench.timeline import plot_rollout_timeline
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.rollout.protocol import Request, RolloutEngine
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

# A short chain, a long chain and a wide tree. `--threshold-on 64` (the threshold policy
# here) turns SD on where the best arm beats plain decoding on the default rollout, at 64
# running rows and below (figures: docs/benchmarks.md).
DEFAULT_ARMS = ("4_1_4", "6_1_6", "8_2_16")
# vLLM's EAGLE-3 drafts a chain (no tree): a short, a middle and a long one.
VLLM_DEFAULT_ARMS = ("4_1_4", "8_1_8", "12_1_12")
# The sampling each engine runs by default: coupled (every method emits the same tokens)
# where the engine has it, else greedy (lossless, the same tokens too).
DEFAULT_MODE = {"torch": "coupled", "vllm": "greedy"}
# The control: the first arm run a second time in every round (the same work twice).
CONTROL = "longtail_control"
# vLLM, --plain-engine: plain decoding on a second engine, built without a drafter.
NO_DRAFTER = "longtail_plain_no_drafter"
# The default workload's options this one refuses, and what it uses instead.
NOT_LONGTAIL = {
    "--shape": "runs every tree shape of --arms (fixed, then adaptive)",
    "--batch-size": "decodes all --num-prompts x --group-size sequences as one batch",
    "--no-hf": "has no HF transformers methods",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed, checked options, with each engine's and policy's defaults filled in
    (`arm_shapes`, `edges` added); a bad option exits with argparse's usage error."""
    p = argparse.ArgumentParser(prog="nemo-tlt bench rollout --workload longtail", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_args(p)
    _add_rollout_args(p)
    _add_policy_args(p)
    _add_run_args(p)
    _add_refused_args(p)
    args = p.parse_args(argv)
    _refuse_default_workload_args(p, args)
    _check_counts(p, args)
    _resolve_engine_args(p, args)
    _resolve_arms(p, args)
    _resolve_policy_args(p, args)
    return args


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The output file, and the engine with its sampling mode and vLLM-only options."""
    p.add_argument("--out", required=True)
    p.add_argument("--workload", choices=["longtail"], default="longtail")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="the embedded torch engine, or vLLM (one engine, EAGLE-3 chains, shared by every method)")
    p.add_argument("--mode", choices=["coupled", "greedy", "rejection"], default=None,
                   help="acceptance / sampling mode (default: coupled on torch, greedy on vllm); coupled and greedy "
                        "make every method emit the same tokens, rejection does not")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="vllm: the KV cache's size in GiB (default 0.5: every sequence of the default rollout "
                        "held at its longest)")
    p.add_argument("--plain-engine", action="store_true",
                   help=f"vllm: also run {NO_DRAFTER}, plain decoding on a second vLLM engine built without a "
                        "drafter (vLLM plain proper: the shared engine's plain steps still carry the drafter's "
                        "cost), and report adaptive_vs_plain_no_drafter")


def _add_rollout_args(p: argparse.ArgumentParser) -> None:
    """The rollout's size and the fixed arms every SD method draws from."""
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--arms", default=None,
                   help=f"comma-separated depth_topk_numverify (default: torch {','.join(DEFAULT_ARMS)}; "
                        f"vllm {','.join(VLLM_DEFAULT_ARMS)}, chains d_1_d only)")


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    """The adaptive method: its policy, the drafter it speculates with, and each policy's knobs."""
    p.add_argument("--policy", choices=["learned", "threshold"], default="learned",
                   help="the adaptive method: learned plain-or-tree per step, or threshold + BEG-MAB")
    p.add_argument("--drafter", choices=["trained", "untrained"], default="trained",
                   help="the demo drafter (vllm: the demo EAGLE-3 drafter), or a freshly initialised one of the "
                        "same shape (seeded by --seed)")
    p.add_argument("--threshold-on", type=int, default=64, help="threshold: SD turns on at <= this many running")
    p.add_argument("--threshold-off", type=int, default=96, help="threshold: SD turns off above this many running")
    p.add_argument("--max-sd-running", type=int, default=None,
                   help="learned: optional bound, never speculate above this many running rows")
    p.add_argument("--bucket-edges", default=None,
                   help="batch-size bucket edges of the threshold policy's bandit and of the headroom report "
                        "(default: learned 2,4,...,128, for the report only; threshold 2,4,8,16)")
    p.add_argument("--epsilon", type=float, default=0.1, help="threshold: the bandit's exploration rate")
    p.add_argument("--min-pulls", type=int, default=None,
                   help="pulls of every arm before exploiting: learned in all (default 2), threshold per bucket (3)")
    p.add_argument("--reward", choices=list(REWARDS), default="scaled",
                   help="threshold: bandit reward, tokens/s over running**(1-b) (b fitted), per running row, "
                        "or tokens/s")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Sampling, the warm policy, the rounds, and where and how the process runs."""
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", action="store_true",
                   help="also run longtail_adaptive_warm: one policy kept across the rounds (as the RL loop does)")
    p.add_argument("--warm-up", type=int, default=1,
                   help="--warm: untimed rollouts the kept policy decodes before the first round")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds over all methods (round-robin); each method reports its median round")
    p.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def _add_refused_args(p: argparse.ArgumentParser) -> None:
    """Options of the default workload that mean nothing here: parsed (hidden from --help)
    only to refuse them by name instead of with argparse's bare "unrecognized arguments"."""
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-hf", action="store_const", const=True, default=None, help=argparse.SUPPRESS)


def _refuse_default_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Drops the options of `_add_refused_args` from `args`; exits naming the first one given."""
    for flag, instead in NOT_LONGTAIL.items():
        if vars(args).pop(flag[2:].replace("-", "_")) is not None:
            p.error(f"{flag} is an option of the default workload; the longtail workload {instead}")


def _check_counts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits unless every count and the temperature are in range."""
    if args.warm_up < 0:
        p.error(f"--warm-up must be >= 0, got {args.warm_up}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    for flag in ("num_prompts", "group_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.temperature <= 0:
        p.error(f"--temperature must be > 0, got {args.temperature}")


def _resolve_engine_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in the engine's default `--mode` and `--kv-cache-gib`; exits on an option the
    engine lacks (coupled sampling on vLLM, a vLLM-only option on torch)."""
    vllm = args.engine == "vllm"
    if args.mode is None:
        args.mode = DEFAULT_MODE[args.engine]
    if vllm and args.mode == "coupled":
        p.error("--mode coupled: vLLM has no coupled sampling (it draws from a per-request generator, not noise "
                "keyed by sequence and position); use --mode greedy (lossless: every method emits the same "
                "tokens) or rejection")
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 0.5 if vllm else None
    elif not vllm:
        p.error("--kv-cache-gib is an option of --engine vllm")
    elif args.kv_cache_gib <= 0:
        p.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.plain_engine and not vllm:
        p.error("--plain-engine is an option of --engine vllm")


def _resolve_arms(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in the engine's default `--arms` and sets `args.arm_shapes`; exits on a tree
    arm on vLLM or an arm listed twice."""
    vllm = args.engine == "vllm"
    if args.arms is None:
        args.arms = ",".join(VLLM_DEFAULT_ARMS if vllm else DEFAULT_ARMS)
    args.arm_shapes = [TreeShape.parse(s, field=f"--arms[{i}]") for i, s in enumerate(args.arms.split(","))]
    trees = [s.name for s in args.arm_shapes if (s.topk, s.num_verify) != (1, s.depth)]
    if vllm and trees:
        p.error(f"--arms {','.join(trees)}: vLLM's EAGLE-3 drafts a chain of the shape's depth, not a tree; "
                "give chains depth_1_depth (e.g. 4_1_4)")
    if len({s.name for s in args.arm_shapes}) != len(args.arm_shapes):
        p.error(f"--arms lists an arm twice: {args.arms}")


def _resolve_policy_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in the policy's default `--bucket-edges` and `--min-pulls` and sets `args.edges`;
    exits on edges that are not integers."""
    learned = args.policy == "learned"
    if args.bucket_edges is None:
        args.bucket_edges = ",".join(map(str, (2, 4, 8, 16, 32, 64, 128) if learned else (2, 4, 8, 16)))
    if args.min_pulls is None:
        args.min_pulls = LearnedSDConfig.min_pulls if learned else 3
    try:
        args.edges = tuple(int(x) for x in args.bucket_edges.split(","))
    except ValueError:
        p.error(f"--bucket-edges must be comma-separated integers, got {args.bucket_edges!r}")


def make_adaptive(args: argparse.Namespace) -> AdaptiveSDPolicy | LearnedSDPolicy:
    """A fresh policy of `longtail_adaptive` (a new one every round: the cold case)."""
    if args.policy == "learned":
        return LearnedSDPolicy(LearnedSDConfig(tuple(args.arm_shapes), min_pulls=args.min_pulls,
                                               max_sd_running=args.max_sd_running))
    bandit = BegMab(BanditConfig(tuple(args.arm_shapes), args.edges, args.epsilon, min_pulls=args.min_pulls),
                    np.random.default_rng(args.seed))
    return AdaptiveSDPolicy(SDPolicyConfig(threshold_on=args.threshold_on, threshold_off=args.threshold_off,
                                           reward=args.reward), bandit)


def untrained_like(drafter, seed: int) -> EagleDrafter:
    """A freshly initialised drafter of the same shape (seeded), for `--drafter untrained`."""
    if not isinstance(drafter, EagleDrafter):
        raise ValueError(f"--drafter untrained: expected the demo EAGLE drafter, got {type(drafter).__name__}")
    return EagleDrafter(drafter.config, generator=torch.Generator().manual_seed(seed)).eval()


def round_ratios(rounds: dict[str, list], best_fixed: str, adaptive: str = "longtail_adaptive") -> dict[str, Any]:
    """Each round's adaptive / plain and adaptive / best fixed (the methods of one round
    ran back to back, so these pair out slow and quiet moments), and the spread of each
    method's wall times between rounds ((max - min) / median)."""
    walls = {name: [r["wall_s"] for r, _ in rs] for name, rs in rounds.items()}
    ada = walls[adaptive]
    per_round = {"adaptive_vs_plain": [a / b for a, b in zip(ada, walls["longtail_plain"])],
                 "adaptive_vs_best_fixed": [a / b for a, b in zip(ada, walls[best_fixed])]}
    if NO_DRAFTER in walls:
        per_round["adaptive_vs_plain_no_drafter"] = [a / b for a, b in zip(ada, walls[NO_DRAFTER])]
    noise = {name: (max(w) - min(w)) / float(np.median(w)) for name, w in walls.items()}
    return {"rounds": per_round, "median": {k: float(np.median(v)) for k, v in per_round.items()},
            "noise": noise}


def longtail_requests(task, num_prompts: int, group: int, seed: int) -> list[Request]:
    _, prompts = task_requests(task, num_prompts, seed)
    return [Request(r.prompt, seq_id=i * group + g) for i, r in enumerate(prompts) for g in range(group)]


def median_ratios(rounds: dict[str, list], key: str, adaptive: str, idx: np.ndarray | None = None) -> dict[str, Any]:
    """adaptive / best fixed arm and adaptive / plain on each method's median ``key`` over
    the rounds ``idx`` (default all; the best fixed arm chosen on ``key`` too), and the
    control: the second run of the first arm / the first (the same work twice)."""
    med = {name: float(np.median([rs[i][0][key] for i in (range(len(rs)) if idx is None else idx)]))
           for name, rs in rounds.items()}
    best = min((v, n) for n, v in med.items() if n.startswith("longtail_fixed_"))[1]
    return {"adaptive_vs_best_fixed": med[adaptive] / med[best],
            "adaptive_vs_plain": med[adaptive] / med["longtail_plain"], "best_fixed": best,
            **({"control": med[CONTROL] / med[_controlled(rounds)]} if CONTROL in med else {}),
            **({"adaptive_vs_plain_no_drafter": med[adaptive] / med[NO_DRAFTER],
                "plain_vs_plain_no_drafter": med["longtail_plain"] / med[NO_DRAFTER]} if NO_DRAFTER in med else {})}


def ratio_intervals(rounds: dict[str, list], key: str, adaptive: str, seed: int) -> dict[str, list[float]]:
    """The 90% percentile bootstrap interval (``scipy.stats.bootstrap``, 2000 resamples) of
    each of :func:`median_ratios`' figures, resampling whole rounds (the methods of a round
    stay together; the best fixed arm is chosen anew in each resample, as the figure chooses it)."""
    from scipy.stats import bootstrap

    rounds_idx = np.arange(len(next(iter(rounds.values()))))
    figures = {k: v for k, v in median_ratios(rounds, key, adaptive).items() if k != "best_fixed"}
    if len(rounds_idx) < 2:  # one round: nothing to resample
        return {k: [v, v] for k, v in figures.items()}

    def statistic(idx: np.ndarray) -> np.ndarray:  # every figure from one resample
        resampled = median_ratios(rounds, key, adaptive, idx)
        return np.array([resampled[k] for k in figures])

    ci = bootstrap((rounds_idx,), statistic, vectorized=False, n_resamples=2000, confidence_level=0.9,
                   method="percentile", rng=np.random.default_rng(seed)).confidence_interval
    return {k: [float(lo), float(hi)] for k, lo, hi in zip(figures, ci.low, ci.high)}


def _controlled(rounds: dict[str, list]) -> str:
    """The fixed arm the control repeats: the first arm of ``--arms`` (run_rounds adds the
    methods in that order, and the control runs ``args.arm_shapes[0]``)."""
    return next(n for n in rounds if n.startswith("longtail_fixed_"))


def _run(engine: RolloutEngine, reqs, sp, policy) -> tuple[dict[str, Any], list[list[int]], Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(reqs, sp, policy=policy)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = out.stats
    return ({"wall_s": wall, "cpu_s": cpu, "tokens": s.tokens_generated, "tokens_per_s": s.tokens_generated / wall,
             "target_forwards": s.target_forwards, "drafter_forwards": s.drafter_forwards,
             "sd_steps": s.sd_steps, "plain_steps": s.plain_steps,
             "mean_accept_len": s.mean_accept_len, "prefill_s": s.prefill_s,
             "outside_steps_s": s.outside_steps_s}, [r.tokens for r in out.results], s.trace)


def median_round(rounds: list[tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
    """The round with the median wall time (the lower middle one for an even count)."""
    ranked = sorted(rounds, key=lambda r: r[0]["wall_s"])
    return ranked[(len(ranked) - 1) // 2]


@dataclass
class Engines:
    """What the methods run on: `plain` decodes `longtail_plain`, `sd` every SD method
    (one object on vLLM); `no_drafter`, where built, decodes `longtail_plain_no_drafter`;
    `name` and `info` go to the JSON's "engine"."""
    plain: RolloutEngine
    sd: RolloutEngine
    name: str
    info: dict[str, Any]
    no_drafter: RolloutEngine | None = None


def torch_engines(target, drafter) -> Engines:
    return Engines(TorchRolloutEngine(target), TorchRolloutEngine(target, drafter), "torch",
                   {"class": TorchRolloutEngine.__name__})


@contextlib.contextmanager
def vllm_engines(args: argparse.Namespace, max_num_seqs: int) -> Iterator[Engines]:
    """One vLLM engine over the demo target, built with the shipped EAGLE-3 drafter (an
    untrained one of its shape loaded in its place with `--drafter untrained`), drafting up
    to the deepest arm; every method runs on it."""
    from nemo_tlt.drafter.eagle3 import Eagle3Drafter
    from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
    from nemo_tlt.drafter.io import load_drafter
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine, import_vllm  # lazy: optional package

    trained = load_drafter(shipped_eagle3_drafter())
    with tempfile.TemporaryDirectory(prefix="nemo_tlt_longtail_eagle3_") as drafter_dir:
        write_eagle3_hf(trained, drafter_dir)
        engine = VLLMRolloutEngine.from_hf_folder(
            SHIPPED_DIR / "target", drafter_dir=drafter_dir, max_num_seqs=max_num_seqs, dtype="float32",
            num_speculative_tokens=max(s.depth for s in args.arm_shapes), kv_cache_gib=args.kv_cache_gib,
            seed=args.seed)
        if args.drafter == "untrained":
            engine.load_drafter(Eagle3Drafter(trained.config, generator=torch.Generator().manual_seed(args.seed)))
        no_drafter = None
        if args.plain_engine:
            no_drafter = VLLMRolloutEngine.from_hf_folder(SHIPPED_DIR / "target", max_num_seqs=max_num_seqs,
                                                          dtype="float32", kv_cache_gib=args.kv_cache_gib,
                                                          seed=args.seed)
        if args.threads:  # vLLM's start-up sets its own thread count
            torch.set_num_threads(args.threads)
        yield Engines(engine, engine, "vllm", {"class": type(engine).__name__,
                                               "vllm_version": import_vllm().__version__,
                                               "num_speculative_tokens": engine.config.num_speculative_tokens,
                                               "max_num_seqs": max_num_seqs, "kv_cache_gib": args.kv_cache_gib,
                                               "plain_engine": no_drafter is not None}, no_drafter)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = AssetConfig()
    reqs = longtail_requests(config.task, args.num_prompts, args.group_size, 30_000 + args.seed)
    # The kept policy's warm-up decodes other prompts: in RL every step's prompts are new.
    warm_up_reqs = longtail_requests(config.task, args.num_prompts, args.group_size, 40_000 + args.seed)
    if args.engine == "vllm":
        with vllm_engines(args, len(reqs)) as engines:
            compare(args, engines, reqs, warm_up_reqs)
        return 0
    target, drafter = load_assets(prepare_assets(config, args.cache_dir))
    if args.drafter == "untrained":
        drafter = untrained_like(drafter, args.seed)
    compare(args, torch_engines(target, drafter), reqs, warm_up_reqs)
    return 0


def run_rounds(args, engines: Engines, reqs: list[Request], sp: SamplingParams,
               warm_up_reqs: list[Request] | None = None):
    """Every method once per round, `args.repeats` rounds (`warm_up_reqs`, default
    `reqs`: what the kept policy of --warm decodes first, untimed; on vLLM every method
    decodes them once first). Returns (rounds: name -> [(result, trace)], outputs: key ->
    token lists, the policy to log (the kept one with --warm, else the last round's fresh
    one), run keys)."""
    plain, sd = engines.plain, engines.sd
    warm_reqs = reqs if warm_up_reqs is None else warm_up_reqs
    if engines.name == "vllm":  # vLLM's first call runs slower (its first prefill)
        for policy in (None, *(FixedSDPolicy(s) for s in args.arm_shapes)):
            sd.generate(warm_reqs, sp, policy=policy)
        if engines.no_drafter is not None:
            engines.no_drafter.generate(warm_reqs, sp)
    else:
        sd.generate(reqs[:2], sp, policy=FixedSDPolicy(args.arm_shapes[0]))  # warm-up
    policies = []

    def fresh():
        policies.append(make_adaptive(args))
        return policies[-1]

    runs = [("longtail_plain", "plain", plain, lambda: None)]
    if engines.no_drafter is not None:
        runs.append((NO_DRAFTER, "plain_no_drafter", engines.no_drafter, lambda: None))
    runs += [(f"longtail_fixed_{s.name}", f"longtail_fixed_{s.name}", sd, lambda s=s: FixedSDPolicy(s))
             for s in args.arm_shapes]
    runs.append((CONTROL, "control", sd, lambda: FixedSDPolicy(args.arm_shapes[0])))
    runs.append(("longtail_adaptive", "adaptive", sd, fresh))
    kept = None
    if args.warm:
        kept = make_adaptive(args)
        for _ in range(args.warm_up):  # its cold rollouts: what `longtail_adaptive` measures
            sd.generate(warm_reqs, sp, policy=kept)
        runs.append(("longtail_adaptive_warm", "adaptive_warm", sd, lambda: kept))
    rounds: dict[str, list] = {name: [] for name, *_ in runs}
    outputs = {}
    for r in range(args.repeats):
        # Round-robin, so load changes hit every method alike; each round starts one method
        # later, so no method always follows the same one (a run's timing can depend on what
        # ran before it), and garbage of the previous run is collected untimed.
        for name, key, engine, make_policy in runs[r % len(runs):] + runs[:r % len(runs)]:
            gc.collect()
            res, outputs[key], trace = _run(engine, reqs, sp, make_policy())
            rounds[name].append((res, trace))
    return rounds, outputs, kept if kept is not None else policies[-1], [(name, key) for name, key, *_ in runs]


def headroom_of(args, traces: dict[str, Any], adaptive_trace) -> dict[str, Any]:
    """The most a per-bucket choice could gain here (estimated from the fixed runs'
    median-round traces), next to what the adaptive run got: steps only, not prefill.
    "oracle_with_plain" lets the oracle decode plainly in a bucket too."""
    bucket_of = _bucket_of(args.edges)
    fixed_traces = {s.name: traces[f"longtail_fixed_{s.name}"] for s in args.arm_shapes}
    headroom = per_bucket_oracle(fixed_traces, bucket_of)
    with_plain = per_bucket_oracle(fixed_traces | {"plain": traces["plain"]}, bucket_of,
                                   reference=headroom["best_fixed"])  # the same work, plain may run it
    headroom["oracle_with_plain_steps_s"] = with_plain["oracle_steps_s"]
    headroom["oracle_with_plain_vs_best_fixed"] = with_plain["oracle_steps_s"] / headroom["best_fixed_steps_s"]
    headroom["best_per_bucket"] = {_label(args.edges, b): arm for b, arm in headroom["best_per_bucket"].items()}
    headroom["best_per_bucket_with_plain"] = {_label(args.edges, b): arm
                                              for b, arm in with_plain["best_per_bucket"].items()}
    headroom["bucket_seconds"] = {  # decode-step seconds per bucket of every method's median round
        name: {_label(args.edges, b): secs for b, secs in sorted(bucket_seconds(trace, bucket_of).items())}
        for name, trace in (fixed_traces | {"plain": traces["plain"], "adaptive": adaptive_trace}).items()}
    headroom["adaptive_steps_s"] = sum(t.seconds for t in adaptive_trace)
    headroom["adaptive_vs_best_fixed_steps"] = headroom["adaptive_steps_s"] / headroom["best_fixed_steps_s"]
    return headroom


def compare(args, engines: Engines, reqs: list[Request], warm_up_reqs: list[Request] | None = None
            ) -> dict[str, Any]:
    """Run every method in rounds, write the JSON and the timeline, print the tables."""
    sp = SamplingParams(args.mode, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        seed=args.seed)
    rounds, outputs, adaptive, runs = run_rounds(args, engines, reqs, sp, warm_up_reqs)
    payload = report(args, engines, rounds, outputs, adaptive, runs, len(reqs))
    write_json_atomic(args.out, payload)
    _print_summary(payload, args.out)
    return payload


def report(args, engines: Engines, rounds: dict[str, list], outputs: dict[str, list[list[int]]],
           adaptive: AdaptiveSDPolicy | LearnedSDPolicy, runs: list[tuple[str, str]], num_seqs: int
           ) -> dict[str, Any]:
    """The JSON payload of `run_rounds`' rounds (drawing the timeline PNG beside `args.out`)."""
    results, traces = median_results(rounds, runs)
    identical = all(o == outputs["plain"] for o in outputs.values())
    lengths = sorted(len(o) for o in outputs["plain"])
    best_fixed = _best_fixed(results)
    per_round = round_ratios(rounds, best_fixed[1])
    warm = warm_ratios(rounds, results, best_fixed) if args.warm else None
    headroom = headroom_of(args, traces, traces["adaptive"])
    png = plot_rollout_timeline({k: traces[k] for k in ("plain", "adaptive")} |
                                {f"fixed {best_fixed[1][len('longtail_fixed_'):]}": traces[best_fixed[1]]},
                                Path(args.out).with_suffix(".png"),
                                title=f"{num_seqs} sequences, response length median {lengths[len(lengths) // 2]}"
                                      f", max {lengths[-1]}")
    return {"benchmark": "rollout", "workload": "longtail", "engine": {"name": engines.name, **engines.info},
            "mode": args.mode, "results": results, "outputs_identical": identical,
            "ratios": wall_ratios(results, best_fixed), "ratios_rounds": per_round["rounds"],
            "ratios_round_median": per_round["median"], "noise": per_round["noise"], "headroom": headroom,
            "timeline_png": str(png),
            **cpu_ratios(args, rounds),
            **({} if warm is None else {
                "ratios_warm": warm["median_of_medians"], "ratios_warm_rounds": warm["rounds"],
                "ratios_warm_round_median": warm["median"],
                "trace_warm": [vars(t) for t in traces["adaptive_warm"]]}),
            **_policy_log(args, adaptive),
            "response_lengths": {"median": lengths[len(lengths) // 2], "max": lengths[-1], "min": lengths[0],
                                 "samples": lengths},  # sorted; `nemo-tlt plan --measured` reads them
            "trace": [vars(t) for t in traces["adaptive"]], "machine": machine_info(),
            "config": {k: v for k, v in vars(args).items() if k not in ("arm_shapes",)}}


def median_results(rounds: dict[str, list], runs: list[tuple[str, str]]
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each method's median round: (results by method name, with every round's wall and CPU
    times added; traces by run key). On a noisy machine the fastest of several rounds
    favours whichever method drew a quiet moment, and "best fixed arm" (a minimum over
    arms too) would be a minimum over arms x rounds."""
    results, traces = {}, {}
    for name, key in runs:
        res, traces[key] = median_round(rounds[name])
        results[name] = res | {"wall_s_rounds": [r["wall_s"] for r, _ in rounds[name]],
                               "wall_s_min": min(r["wall_s"] for r, _ in rounds[name]),
                               "cpu_s_rounds": [r["cpu_s"] for r, _ in rounds[name]]}
    return results, traces


def _best_fixed(results: dict[str, dict[str, Any]]) -> tuple[float, str]:
    """(wall_s, name) of the fixed arm with the least median-round wall time."""
    return min((r["wall_s"], n) for n, r in results.items() if n.startswith("longtail_fixed_"))


def wall_ratios(results: dict[str, dict[str, Any]], best_fixed: tuple[float, str]) -> dict[str, Any]:
    """`ratios`: the cold adaptive run against plain decoding and the best fixed arm (and,
    where run, plain decoding without a drafter), on median-round wall times."""
    ada, plain = results["longtail_adaptive"]["wall_s"], results["longtail_plain"]["wall_s"]
    return {"adaptive_vs_plain": ada / plain,
            "adaptive_vs_best_fixed": ada / best_fixed[0], "best_fixed": best_fixed[1],
            "speedup_vs_plain": plain / ada,
            "best_fixed_vs_plain": best_fixed[0] / plain,
            **({"adaptive_vs_plain_no_drafter": ada / results[NO_DRAFTER]["wall_s"],
                "plain_vs_plain_no_drafter": plain / results[NO_DRAFTER]["wall_s"]}
               if NO_DRAFTER in results else {})}


def warm_ratios(rounds: dict[str, list], results: dict[str, dict[str, Any]], best_fixed: tuple[float, str]
                ) -> dict[str, Any]:
    """`round_ratios` of `longtail_adaptive_warm`, with its ratios on median-round wall
    times (`median_of_medians`)."""
    ada_warm = results["longtail_adaptive_warm"]["wall_s"]
    warm = round_ratios(rounds, best_fixed[1], "longtail_adaptive_warm")
    warm["median_of_medians"] = {"adaptive_vs_best_fixed": ada_warm / best_fixed[0],
                                 "adaptive_vs_plain": ada_warm / results["longtail_plain"]["wall_s"],
                                 **({"adaptive_vs_plain_no_drafter": ada_warm / results[NO_DRAFTER]["wall_s"]}
                                    if NO_DRAFTER in results else {})}
    return warm


def cpu_ratios(args, rounds: dict[str, list]) -> dict[str, Any]:
    """The same ratios on CPU time (one thread: the work each method did), which other
    processes taking the cores inflate far less than wall time, with their bootstrap
    intervals; the warm policy's too with --warm."""
    return {"control_of": _controlled(rounds),  # the fixed arm the control repeats
            "ratios_cpu": median_ratios(rounds, "cpu_s", "longtail_adaptive"),
            "ratios_cpu_interval": ratio_intervals(rounds, "cpu_s", "longtail_adaptive", args.seed),
            **({} if not args.warm else {
                "ratios_warm_cpu": median_ratios(rounds, "cpu_s", "longtail_adaptive_warm"),
                "ratios_warm_cpu_interval": ratio_intervals(rounds, "cpu_s", "longtail_adaptive_warm",
                                                            args.seed)})}


def _policy_log(args, adaptive: AdaptiveSDPolicy | LearnedSDPolicy) -> dict[str, Any]:
    """The logged policy's state: its bandit (or learned costs) and fitted step-time exponents."""
    learned = isinstance(adaptive, LearnedSDPolicy)
    return {"bandit": adaptive.log_dict() if learned else adaptive.bandit.log_dict(),
            "step_time_exponent": (adaptive.costs.pooled_exponent() if learned else adaptive.step_cost.exponent()),
            "step_time_exponents": ({"plain" if a is None else a.name: adaptive.costs.exponent(i)
                                     for i, a in enumerate((None, *args.arm_shapes))} if learned else None)}


def _print_summary(payload: dict[str, Any], out: str) -> None:
    results, ratios, headroom = payload["results"], payload["ratios"], payload["headroom"]
    print(format_table(results, ["wall_s", "tokens_per_s", "target_forwards", "sd_steps", "mean_accept_len",
                                 "outside_steps_s"]))
    print("ratios: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in ratios.items()))
    for label, key in (("on CPU time", "ratios_cpu"), ("warm, on CPU time", "ratios_warm_cpu")):
        if key in payload:
            spans = payload[f"{key}_interval"]
            print(f"{label}: " + ", ".join(
                f"{k}={v:.3f} [{spans[k][0]:.3f}, {spans[k][1]:.3f}]" if k in spans else f"{k}={v}"
                for k, v in payload[key].items()) + " ([90% bootstrap interval over rounds])")
    if "ratios_warm" in payload:
        print("ratios_warm: " + ", ".join(f"{k}={v:.2f}" for k, v in payload["ratios_warm"].items())
              + " | per round: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v)
                                             for k, v in payload["ratios_warm_rounds"].items()))
    print("per round: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v)
                                    for k, v in payload["ratios_rounds"].items())
          + " | noise (max-min)/median: " + ", ".join(f"{k[len('longtail_'):]}={v:.2f}"
                                                    for k, v in payload["noise"].items()))
    print(f"decode steps: per-bucket oracle {headroom['oracle_vs_best_fixed']:.2f}x the best fixed arm "
          f"({headroom['best_fixed']}), with plain {headroom['oracle_with_plain_vs_best_fixed']:.2f}x, "
          f"adaptive {headroom['adaptive_vs_best_fixed_steps']:.2f}x")
    expected = " (rejection sampling: not expected)" if payload["mode"] == "rejection" else ""
    print(f"engine: {payload['engine']['name']}, mode {payload['mode']}; outputs_identical: "
          f"{payload['outputs_identical']}{expected}; timeline: {payload['timeline_png']}; wrote {out}")


def _bucket_of(edges: tuple[int, ...]):
    return lambda running: int(np.searchsorted(np.asarray(edges), running, side="right"))


def _label(edges: tuple[int, ...], bucket: int) -> str:
    lo = 1 if bucket == 0 else edges[bucket - 1]
    return f"[{lo},{edges[bucket] if bucket < len(edges) else 'inf'})"
