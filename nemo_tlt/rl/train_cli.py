"""`nemo-tlt train CONFIG.yaml [key=value ...] [--compare-baseline]`: parse -> build -> run.

* The config is ``nemo_tlt.config.TLTConfig``: YAML merged over the defaults, then
  the ``key=value`` overrides; an unknown key or a wrong type is refused naming the
  key. The resolved config is printed and saved as ``<run_dir>/config.yaml``.
* Without ``model.target_dir`` the demo assets are used: the SFT warm start and the
  EAGLE drafter that ``nemo-tlt prepare`` / the benchmarks train once and cache.
* A run writes ``<run_dir>/<mode>/`` (metrics.jsonl, tb/, checkpoints/), with mode
  ``tlt`` or ``baseline`` (SD and idle-time drafter training both off). With
  ``--compare-baseline`` the same config runs as TLT, then as baseline, with the
  same seeds; ``<run_dir>/report.json`` compares them. The PNG plots go to
  ``<run_dir>``. The run folder is printed at the end.
* Exit status: 0 done, 2 bad usage or config, 130 interrupted (SIGINT/SIGTERM; the
  run was checkpointed: rerun with ``resume=true`` to continue).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from nemo_tlt.config import TLTConfig, load_config
from nemo_tlt.rl.loop import RunSpec, prepare_run_dir, run_rank
from nemo_tlt.rl.report import compare, write_plots
from nemo_tlt.rl.workers import launch

log = logging.getLogger(__name__)
USAGE = "usage: nemo-tlt train CONFIG.yaml [key=value ...] [--compare-baseline]"
EXIT_INTERRUPTED = 130


def parse_argv(argv: list[str]) -> tuple[str | None, list[str], bool]:
    """(config path, overrides, compare_baseline); raises ValueError on bad usage."""
    compare_flag = "--compare-baseline" in argv
    rest = [a for a in argv if a != "--compare-baseline"]
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}")
    if not rest:
        raise ValueError("missing CONFIG.yaml")
    if "=" in rest[0]:
        raise ValueError(f"the first argument must be the config file, got the override {rest[0]!r}")
    return rest[0], rest[1:], compare_flag


def resolve_models(config: TLTConfig) -> tuple[str, str]:
    """(target_dir, drafter_dir): the configured folders, or the cached demo assets."""
    if config.model.target_dir is not None:
        return config.model.target_dir, config.model.drafter_dir
    from nemo_tlt.rl.assets import AssetConfig, prepare_assets  # trains once, then cached

    assets_config = AssetConfig()
    if config.task.to_task_config() != assets_config.task:
        log.warning("task differs from the task the demo warm start was trained on (%s)", assets_config.task)
    assets = prepare_assets(assets_config, config.model.cache_dir, progress=config.progress)
    return str(assets.target_dir), str(assets.drafter_dir)


def build_specs(config: TLTConfig, compare_baseline: bool, target_dir: str, drafter_dir: str) -> list[RunSpec]:
    mode = "tlt" if (config.rollout.sd_enabled or config.drafter.train_on_idle) else "baseline"
    if compare_baseline and mode != "tlt":
        raise ValueError("--compare-baseline needs a TLT config (rollout.sd_enabled or drafter.train_on_idle true)")
    runs = [(mode, config)] + ([("baseline", config.baseline())] if compare_baseline else [])
    return [RunSpec(cfg, m, str(Path(config.run_dir) / m), target_dir, drafter_dir) for m, cfg in runs]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        print(USAGE)
        return 0
    try:
        path, overrides, compare_baseline = parse_argv(argv)
        config = load_config(path, overrides)
    except ValueError as err:
        print(f"nemo-tlt train: error: {err}\n{USAGE}", file=sys.stderr)
        return 2
    resolved = config.to_yaml()
    print(resolved)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved)
    try:
        target_dir, drafter_dir = resolve_models(config)
        specs = build_specs(config, compare_baseline, target_dir, drafter_dir)
        for spec in specs:
            prepare_run_dir(spec)
    except ValueError as err:
        print(f"nemo-tlt train: error: {err}", file=sys.stderr)
        return 2
    summaries = {}
    for spec in specs:
        summaries[spec.mode] = summary = launch(spec, run_rank)
        if summary["status"] != "completed":
            break
    _write_report(run_dir, summaries)
    print(f"run folder: {run_dir.resolve()}")
    if any(s["status"] != "completed" for s in summaries.values()):
        print(f"interrupted and checkpointed; continue with: nemo-tlt train {path} {' '.join(overrides)} "
              f"resume=true{' --compare-baseline' if compare_baseline else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _write_report(run_dir: Path, summaries: dict) -> None:
    runs = {mode: s["records"] for mode, s in summaries.items() if s["records"]}
    report: dict = {}
    if runs:
        report["plots"] = write_plots(runs, run_dir)
    if "tlt" in summaries and "baseline" in summaries:
        report.update(compare(summaries["tlt"], summaries["baseline"]))
        t_mean, b_mean = report["tlt"]["mean_step_s_after_first"], report["baseline"]["mean_step_s_after_first"]
        print(f"TLT vs baseline: speedup {report['speedup']:.2f}x (mean step time after the first: "
              f"{t_mean:.1f}s vs {b_mean:.1f}s), "
              f"rollout speedup {report['rollout_speedup']:.2f}x, baseline rollout share "
              f"{report['baseline_rollout_share']:.0%}, rewards identical: {report['rewards_identical']}")
    else:
        for mode, s in summaries.items():
            report[mode] = {"step_times": [r["step_s"] for r in s["records"]], "wall_s": s["wall_s"],
                            "status": s["status"], "out_dir": s["out_dir"]}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
