"""`nemo-tlt train CONFIG.yaml [key=value ...] [--compare-baseline [--pairs N]]`: parse -> build -> run.

* The config is ``nemo_tlt.config.TLTConfig``: YAML merged over the defaults, then
  the ``key=value`` overrides; an unknown key or a wrong type is refused naming the
  key. The resolved config is printed and saved as ``<run_dir>/config.yaml``.
* Without ``model.target_dir`` the demo assets are used: the SFT warm start and the
  EAGLE drafter shipped with the package (``nemo_tlt.demo.assets.prepare_assets``;
  trained once and cached where the configuration differs from the shipped one).
* A single run writes ``<run_dir>/<mode>/`` (metrics.jsonl, tb/, checkpoints/,
  summary.json), with mode ``tlt`` or ``baseline`` (SD and idle-time drafter
  training both off).
* ``--compare-baseline`` runs the same config as TLT and as baseline, with the same
  seeds, in ``--pairs N`` pairs (default 2) whose order alternates: pair 1 TLT then
  baseline, pair 2 baseline then TLT, and so on, so that neither mode always gets
  the machine's first (or last) slot. Run k of mode m writes ``<run_dir>/pair<k>/<m>/``
  (an absolute ``checkpoint.dir`` gets the same ``pair<k>/<m>`` subfolders).
  ``<run_dir>/report.json`` holds every run and the medians over pairs
  (``nemo_tlt.rl.reporting.report.compare_pairs``); a per-pair table is printed, with the
  TLT - baseline reward difference and its 95% interval, and, where the runs sampled
  different tokens, the per-token figures and the report's ``sampling_note``; the reward
  curves with their intervals go to ``<run_dir>/reward_curves.png``.
* The PNG plots (every run) go to ``<run_dir>``. The run folder is printed at the end.
* ``resume=true`` continues an interrupted run from its checkpoint and skips a run
  whose ``summary.json`` says it completed all ``steps``.
* Exit status: 0 done, 2 bad usage or config, 130 interrupted (SIGINT/SIGTERM; the
  run was checkpointed: rerun with ``resume=true`` to continue).
* Under ``srun`` or ``torchrun`` (SLURM / torchrun launch mode,
  ``nemo_tlt.rl.workers.launch_mode``) every task runs this command as one worker; only
  rank 0 prints the config, writes the run's files (config, summaries, report, plots)
  and exits with the status above (the other ranks exit 0 once their part ended,
  interrupted or not). The run folder must be on a file system every node shares.
  The saved ``config.yaml`` names the launcher and device kind actually used
  (``workers.launcher``: local, slurm or torchrun; ``workers.device``: cpu or cuda).
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nemo_tlt.algorithms.registry import check_algorithm
from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.config import TaskConfig, TLTConfig, load_config
from nemo_tlt.policy.config import BACKENDS
from nemo_tlt.rollout.config import ENGINES
from nemo_tlt.rl.loop import run_rank
from nemo_tlt.rl.run import RunSpec, prepare_run_dir
from nemo_tlt.rl.data.task import build_task
from nemo_tlt.rl.data.validation import validation_prompts
from nemo_tlt.rl.reporting.loggers import check_available
from nemo_tlt.rl.reporting.plots import plot_reward_curves, write_plots
from nemo_tlt.rl.reporting.report import compare_pairs, format_pairs, read_validation, run_block
from nemo_tlt.rl.workers import launch, process_rank, resolved_workers

log = logging.getLogger(__name__)
USAGE = "usage: nemo-tlt train CONFIG.yaml [key=value ...] [--compare-baseline [--pairs N]]"
EXIT_INTERRUPTED = 130
DEFAULT_PAIRS = 2
SUMMARY = "summary.json"


@dataclass(frozen=True)
class TrainArgs:
    config: str
    overrides: list[str] = field(default_factory=list)
    compare_baseline: bool = False
    pairs: int = DEFAULT_PAIRS  # TLT/baseline pairs (with compare_baseline only)


@dataclass(frozen=True)
class PlannedRun:
    """One run of the plan; `pair` is 1-based (None for a run without a baseline)."""

    pair: int | None
    spec: RunSpec

    @property
    def label(self) -> str:
        return self.spec.mode if self.pair is None else f"{self.spec.mode} (pair {self.pair})"


def _parse_pairs(value: str) -> int:
    try:
        pairs = int(value)
    except ValueError:
        raise ValueError(f"--pairs must be an integer >= 1, got {value!r}") from None
    if pairs < 1:
        raise ValueError(f"--pairs must be an integer >= 1, got {pairs}")
    return pairs


def parse_argv(argv: list[str]) -> TrainArgs:
    """The command line's arguments; raises ValueError on bad usage."""
    compare, pairs, rest = False, None, []
    args = iter(argv)
    for arg in args:
        if arg == "--compare-baseline":
            compare = True
        elif arg == "--pairs":
            value = next(args, None)
            if value is None:
                raise ValueError("--pairs needs a value (the number of TLT/baseline pairs, >= 1)")
            pairs = _parse_pairs(value)
        elif arg.startswith("--pairs="):
            pairs = _parse_pairs(arg.split("=", 1)[1])
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg!r}")
        else:
            rest.append(arg)
    if pairs is not None and not compare:
        raise ValueError("--pairs needs --compare-baseline (it sets how many TLT/baseline pairs run)")
    if not rest:
        raise ValueError("missing CONFIG.yaml")
    if "=" in rest[0]:
        raise ValueError(f"the first argument must be the config file, got the override {rest[0]!r}")
    return TrainArgs(rest[0], rest[1:], compare, DEFAULT_PAIRS if pairs is None else pairs)


def pair_orders(pairs: int) -> list[tuple[str, str]]:
    """Run order of each pair: TLT first in odd pairs (1, 3, ...), the baseline first in even ones."""
    return [("tlt", "baseline") if k % 2 == 1 else ("baseline", "tlt") for k in range(1, pairs + 1)]


def resolve_models(config: TLTConfig) -> tuple[str, str]:
    """(target_dir, drafter_dir): the configured folders, or the cached demo assets (with
    ``rollout.engine=vllm`` the shipped EAGLE-3 drafter of the demo target)."""
    if config.model.target_dir is not None:
        return config.model.target_dir, config.model.drafter_dir
    from nemo_tlt.demo.assets import AssetConfig, prepare_assets  # shipped, or trained once and cached

    from nemo_tlt.demo.tasks import ArithTaskSource

    assets_config, demo = AssetConfig(), TaskConfig()
    if (config.task.source != demo.source or config.task.tokenizer != demo.tokenizer
            or ArithTaskSource(**config.task.options).config != assets_config.task):
        log.warning("task differs from the task the demo warm start was trained on (%s)", assets_config.task)
    assets = prepare_assets(assets_config, config.model.cache_dir, progress=config.progress)
    if config.rollout.engine == "vllm":  # vLLM serves EAGLE-3 drafters: the shipped one of the demo target
        from nemo_tlt.demo.shipped_assets import shipped_eagle3_drafter
        return str(assets.target_dir), str(shipped_eagle3_drafter())
    return str(assets.target_dir), str(assets.drafter_dir)


def build_plan(config: TLTConfig, args: TrainArgs, target_dir: str, drafter_dir: str) -> list[PlannedRun]:
    """The runs to make, in order (see the module docstring for the folders)."""
    mode = "tlt" if (config.rollout.sd_enabled or config.drafter.train_on_idle) else "baseline"
    run_dir = Path(config.run_dir)
    if not args.compare_baseline:
        return [PlannedRun(None, RunSpec(config, mode, str(run_dir / mode), target_dir, drafter_dir))]
    if mode != "tlt":
        raise ValueError("--compare-baseline needs a TLT config (rollout.sd_enabled or drafter.train_on_idle true)")
    configs = {"tlt": config, "baseline": config.baseline()}
    plan = []
    for k, order in enumerate(pair_orders(args.pairs), 1):
        for m in order:
            sub = Path(f"pair{k}") / m
            cfg = configs[m]
            if Path(cfg.checkpoint.dir).is_absolute():  # one checkpoint folder per run, as for relative ones
                cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(Path(cfg.checkpoint.dir) / sub)))
            plan.append(PlannedRun(k, RunSpec(cfg, m, str(run_dir / sub), target_dir, drafter_dir)))
    return plan


def completed_summary(spec: RunSpec) -> dict[str, Any] | None:
    """With resume=true, the saved summary of a run that already finished all its steps."""
    path = Path(spec.out_dir) / SUMMARY
    if not (spec.config.resume and path.is_file()):
        return None
    summary = json.loads(path.read_text())
    done = summary["status"] == "completed" and summary["next_step"] == spec.config.steps
    return summary if done else None


def run_plan(plan: list[PlannedRun], primary: bool = True) -> list[tuple[PlannedRun, dict[str, Any]]]:
    """Run (or, on resume, skip finished) runs in order; stops after an interrupted one.

    Only the `primary` process writes summaries; every SLURM task takes the same
    decisions (a summary file is only ever removed when it does not count as done)."""
    done = []
    for run in plan:
        summary = completed_summary(run.spec)
        if summary is not None:
            if primary:
                print(f"{run.label}: completed before, skipped (resume=true)")
        else:
            if primary:
                (Path(run.spec.out_dir) / SUMMARY).unlink(missing_ok=True)
            summary = launch(run.spec, run_rank)
            if summary["status"] == "completed" and primary:
                write_json_atomic(Path(run.spec.out_dir) / SUMMARY, summary)  # resume trusts only whole files
        done.append((run, summary))
        if summary["status"] != "completed":
            break
    return done


def _check_engine(config: TLTConfig) -> str | None:
    """What the chosen engine refuses of this run, or its missing package, before any model is
    loaded or worker started (None: nothing)."""
    if config.rollout.engine == "trtllm":
        from nemo_tlt.rollout.trtllm_run import TrainRunAsks, train_run_refusal
        return train_run_refusal(TrainRunAsks.of(config), config.rollout.trtllm)
    if config.rollout.engine == "vllm":
        from nemo_tlt.rollout.vllm_config import missing_package_message, vllm_installed
        if not vllm_installed():
            return missing_package_message("rollout.engine=vllm")
    return None


def _load(argv: list[str]) -> tuple[TrainArgs, TLTConfig]:
    """The arguments and the checked config; an engine, backend or algorithm named by import
    path is imported now, so a wrong path stops here, before any worker starts (the built-in
    ones import their optional packages only when built)."""
    args = parse_argv(argv)
    config = load_config(args.config, args.overrides)
    ENGINES.get(config.rollout.engine)
    BACKENDS.get(config.policy.backend)
    check_algorithm(config.algorithm, config.algorithm_options, config.grpo.group_size,
                    config.grpo.max_new_tokens)
    return args, config


def _prepare(config: TLTConfig, args: TrainArgs, primary: bool) -> list[PlannedRun]:
    """The runs to make, their folders prepared (rank 0), everything a run reads checked once."""
    target_dir, drafter_dir = resolve_models(config)
    build_task(config.task, target_dir)  # imports the user's source, reward and tokenizer now, once
    check_available(config.logger)  # a chosen W&B / MLflow logger is installed
    if config.validation.every > 0:
        validation_prompts(config)  # the validation split can be read (a bad file or count fails here)
    plan = build_plan(config, args, target_dir, drafter_dir)
    for run in plan if primary else ():
        prepare_run_dir(run.spec)
    return plan


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        print(USAGE)
        return 0
    try:
        args, config = _load(argv)
    except ValueError as err:
        print(f"nemo-tlt train: error: {err}\n{USAGE}", file=sys.stderr)
        return 2
    refusal = _check_engine(config)
    if refusal is not None:
        print(f"nemo-tlt train: error: {refusal}", file=sys.stderr)
        return 2
    try:
        # The launcher (local, SLURM or torchrun) and the device kind are chosen here, once:
        # the runs and their config.yaml get what is used, never `auto`.
        config = replace(config, workers=resolved_workers(config.workers))
        primary = process_rank(config.workers) == 0
        run_dir = Path(config.run_dir)
        if primary:
            resolved = config.to_yaml()
            print(resolved)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(resolved)
        plan = _prepare(config, args, primary)
    except ValueError as err:
        print(f"nemo-tlt train: error: {err}", file=sys.stderr)
        return 2
    results = run_plan(plan, primary)
    if not primary:
        # The step's exit status is rank 0's: a peer leaving non-zero first would make
        # `srun --kill-on-bad-exit` kill rank 0 while it writes the report.
        return 0
    _write_report(run_dir, results, args.compare_baseline, config.grpo.group_size)
    print(f"run folder: {run_dir.resolve()}")
    if any(s["status"] != "completed" for _, s in results):
        flags = f" --compare-baseline --pairs {args.pairs}" if args.compare_baseline else ""
        print(f"interrupted and checkpointed; continue with: nemo-tlt train {args.config} "
              f"{' '.join(args.overrides)} resume=true{flags}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _write_report(run_dir: Path, results: list[tuple[PlannedRun, dict[str, Any]]], compare: bool,
                  group_size: int) -> None:
    report: dict[str, Any] = {}
    runs = {run.label: s["records"] for run, s in results if s["records"]}
    if runs:
        validation = {run.label: read_validation(s["out_dir"]) for run, s in results}
        report["plots"] = write_plots(runs, run_dir, validation={k: v for k, v in validation.items() if v})
    if not compare:
        for run, s in results:
            report[run.spec.mode] = {"step_times": [r["step_s"] for r in s["records"]], "wall_s": s["wall_s"],
                                     "status": s["status"], "out_dir": s["out_dir"]}
    else:
        report["runs"] = [{"pair": run.pair, **run_block(s)} for run, s in results]
        pairs = _completed_pairs(results)
        if pairs:
            report.update(compare_pairs(pairs, group_size=group_size))
            curves = plot_reward_curves(report["reward_curves"], run_dir / "reward_curves.png")
            report.setdefault("plots", {})["reward_curves"] = str(curves)
            _print_comparison(report)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))


def _completed_pairs(results: list[tuple[PlannedRun, dict[str, Any]]]) -> list[tuple[tuple[str, str], dict, dict]]:
    by_pair: dict[int, list[tuple[str, dict]]] = {}
    for run, s in results:
        if s["status"] == "completed":
            by_pair.setdefault(run.pair, []).append((run.spec.mode, s))
    pairs = []
    for k in sorted(by_pair):
        if len(by_pair[k]) == 2:
            (first, s1), (second, s2) = by_pair[k]
            summaries = {first: s1, second: s2}
            pairs.append(((first, second), summaries["tlt"], summaries["baseline"]))
    return pairs


def _print_comparison(report: dict[str, Any]) -> None:
    print(format_pairs(report))
    print(f"TLT vs baseline, medians over {len(report['pairs'])} pair(s): speedup {report['speedup']:.2f}x "
          f"(baseline / TLT mean step time after the first), rollout speedup {report['rollout_speedup']:.2f}x, "
          f"baseline rollout share {report['baseline_rollout_share']:.0%}, control ratio (update work, "
          f"baseline / TLT) {report['control_ratio']:.2f}; rewards identical in every run: "
          f"{report['rewards_identical']}, rollouts: {report['rollouts_identical']}, final policy weights: "
          f"{report['final_policy_identical']}")
    print(f"policy update after the rollout: TLT {report['tlt_update_s']:.2f} s of {report['tlt_update_work_s']:.2f} s "
          f"of update work per worker, baseline {report['baseline_update_s']:.2f} s of "
          f"{report['baseline_update_work_s']:.2f} s (policy.pipelined_update does the rest in the rollout's tail)")
    if not report["rollouts_identical"]:
        print(f"per token (the runs sampled different lengths: TLT {report['tlt_mean_tokens']:.1f}, "
              f"baseline {report['baseline_mean_tokens']:.1f} response tokens/step): speedup per response token "
              f"{report['speedup_per_token']:.2f}x, control ratio per prompt + response token "
              f"{report['control_ratio_per_token']:.2f}")
    diff = report["reward_curves"]["reward_difference"]
    print(f"mean reward TLT - baseline over all steps, paired by prompt group: {diff['mean']:+.4f}, 95% interval "
          f"[{diff['low']:+.4f}, {diff['high']:+.4f}] ({'contains' if diff['interval_contains_zero'] else 'excludes'}"
          f" 0; TLT {diff['tlt_mean']:.4f}, baseline {diff['baseline_mean']:.4f} over {diff['cells']} (step, prompt) "
          f"cells, each the mean of {diff['runs']['tlt']} TLT / {diff['runs']['baseline']} baseline run(s))")
    if report["sampling_note"]:
        print(f"NOTE: {report['sampling_note']}")
    if report["noisy"]:
        print(f"WARNING: {report['note']}")


if __name__ == "__main__":
    sys.exit(main())
