"""`nemo-tlt plan CONFIG.yaml [key=value ...] [--out F.json] [--simulate] [--png F.png]`: parse -> plan -> print / write.

`--measured RUN_DIR_OR_BENCH_JSON` (repeatable; or the plan's ``measured.run_dir`` /
``measured.bench_json``) puts measured response lengths, accepted lengths per arm and
calibrated costs in place of the assumed ones (``nemo_tlt.plan.measured``); the JSON's
``inputs`` says which inputs were measured and from where. `--sensitivity` simulates
the plan with each assumption at both ends of its range (``nemo_tlt.plan.sensitivity``)
and prints that table's JSON (and, with ``--markdown``, the table as Markdown).

`nemo-tlt plan --calibrate RUN_DIR [--out F.json]` instead fits this machine's step costs
on a `nemo-tlt train --compare-baseline` run folder and predicts its phase times
(``nemo_tlt.plan.calibrate``).

Exit status: 0 when the plan fits, 1 when it does not fit
(the JSON is still written, with ``fits: false`` and the ``refusal``), 2 on bad input.
With ``--calibrate``: 0 once the JSON is written, whether or not the targets are met.
"""
from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="plan YAML (see conf/*_plan.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--simulate", action="store_true", help="simulate RL steps with and without TLT")
    p.add_argument("--png", help="with --simulate: the slowest step's timeline as a PNG")
    p.add_argument("--measured", action="append", default=[], metavar="RUN_DIR_OR_BENCH_JSON",
                   help="measured inputs: a `nemo-tlt train` run folder or a `nemo-tlt bench rollout` JSON")
    p.add_argument("--sensitivity", action="store_true",
                   help="predicted speedup with each assumption at both ends of its range, one at a time")
    p.add_argument("--markdown", action="store_true", help="with --sensitivity: also print the Markdown table")
    p.add_argument("--calibrate", metavar="RUN_DIR",
                   help="fit costs on a `nemo-tlt train --compare-baseline` run folder and predict its phases")
    p.add_argument("--folds", choices=("pairs", "steps"), default="pairs",
                   help="with --calibrate: predict each pair from the others (default) or odd steps from even")
    return p


def _calibrate(args: argparse.Namespace) -> int:
    if args.config or args.overrides or args.simulate or args.png:
        print("nemo-tlt plan: --calibrate takes a run folder only (no CONFIG.yaml, overrides, --simulate or --png)",
              file=sys.stderr)
        return 2
    from nemo_tlt.plan.calibrate import calibrate
    try:
        result = calibrate(args.calibrate, args.folds)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"nemo-tlt plan --calibrate: {err}", file=sys.stderr)
        return 2
    _emit(result, args.out)
    return 0


def _emit(result: dict, out: str | None) -> None:
    """Print the result as JSON and, with --out, write the same text to that file."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> int:
    # intermixed: key=value overrides may also follow the options, as `nemo-tlt train` takes them
    args = _parser().parse_intermixed_args(argv)
    if args.calibrate:
        return _calibrate(args)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides, args.config = [args.config, *args.overrides], None  # overrides of the defaults only
    try:
        from nemo_tlt.plan.build import make_plan
        from nemo_tlt.plan.config import load_plan_config
        plan = load_plan_config(args.config, args.overrides)
        if args.sensitivity:
            from nemo_tlt.plan.sensitivity import markdown_table, sensitivity
            result = sensitivity(plan, args.measured)
            _emit(result, args.out)
            if args.markdown:
                print(markdown_table(result))
            return 0
        result, runs = make_plan(plan, simulate_steps=args.simulate or bool(args.png), measured=args.measured)
        fits = result["fits"]
        if args.png and runs is not None:
            _png(runs, result, args.png)
    except (ValueError, FileNotFoundError) as err:
        print(f"nemo-tlt plan: {err}", file=sys.stderr)
        return 2
    _emit(result, args.out)
    if not fits:
        print(f"nemo-tlt plan: {result['refusal']}", file=sys.stderr)
        return 1
    return 0


def _png(runs: dict, result: dict, path: str) -> None:
    from nemo_tlt.plan.timeline_png import plot_step

    worst = max(range(len(runs["baseline"])), key=lambda i: runs["baseline"][i].step_s)
    phases = {k: v for k, v in result["simulation"]["phases_s"].items()}
    plot_step({"baseline": runs["baseline"][worst], "TLT": runs["tlt"][worst]}, phases, path)
    result["simulation"]["timeline_png"] = path


if __name__ == "__main__":
    sys.exit(main())
