"""Run reports: metrics JSONL + TensorBoard while a run goes, PNG plots and the
TLT-vs-baseline ``report.json`` after it.

Contract
--------
* ``MetricsWriter`` (rank 0 only) appends one JSON object per RL step to
  ``<run>/metrics.jsonl``, and per validation pass one with ``"split": "validation"``
  (``nemo_tlt.rl.validation``); the numeric fields go to the sinks the ``logger:``
  block chooses (``nemo_tlt.rl.loggers``: TensorBoard under ``<run>/tb``, W&B, MLflow)
  as ``<mode>/<key>`` and ``<mode>/validation/<key>``. On resume it rewrites the JSONL
  from the checkpoint's records (and the validation records of those steps), so the
  file never holds steps the resumed run will redo.
* Plots read step records only (the dicts ``nemo_tlt.rl.loop`` produces), of every
  run given (``write_plots``; with ``--compare-baseline`` every run of every pair):
  reward vs step, step-time breakdown (rollout / log-prob / update / weight sync /
  other, with drafter-training worker-seconds beside it), accepted length per step,
  worker timeline (BUSY / IDLE / TRAINING per worker, with a strip inside the BUSY
  rollout time showing where the worker decoded plainly and where with SD, per tree
  shape, from the records' ``decode_segments``); rows name their node when the run
  spanned several (``rank_nodes``); a resumed run's steps follow its predecessor's,
  with a mark where it took over (``process_runs``). Validation records, mixed in or
  given apart, make a validation curve (``validation_vs_step.png``).
* TLT and its baseline run in pairs of alternating order. ``pair_figures`` compares
  the two runs of one pair on means over the steps after the first (the first pays
  one-time warm-up); ``compare_pairs`` gives the ``report.json`` figures as medians
  over pairs. Its ``control_ratio`` is the baseline / TLT ratio of the policy update's
  work (``update_work_s``: worker-seconds of log-probs, gradients and step per worker,
  wherever and whenever they ran; records without it: ``update_s``), work that is identical
  in both runs: outside
  [1 - CONTROL_TOLERANCE, 1 + CONTROL_TOLERANCE] the machine's speed changed between
  the runs of a pair enough to swamp the speedup, and the report says so
  (``noisy``, ``note``). ``rewards_identical`` / ``rollouts_identical`` compare every
  run of every pair, ``final_policy_identical`` the digests of the policies they end with.
  The step-time breakdown shows ``update_s``, the update after the rollout; with
  ``policy.pipelined_update`` the part done during the tail shows in the worker timeline
  (an "update" strip) and in ``update_work_s``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nemo_tlt.rl.loggers import LoggerConfig, build_sinks, finite_scalars

BREAKDOWN = (("rollout_s", "rollout"), ("logprob_s", "log-prob"), ("update_s", "update"),
             ("weight_sync_s", "weight sync"), ("other_s", "other"))
STATE_COLORS = {"busy": "#4477aa", "idle": "#dddddd", "training": "#ee7733"}
# decode strips: plain dark, SD shapes in colours the worker states do not use
PLAIN_COLOR = "#333333"
UPDATE_COLOR = "#ee3377"  # the pipelined update's group gradients, in the strip beside the decoding
SHAPE_COLORS = ("#44bb99", "#aa3377", "#ccbb44", "#99ddff", "#882255", "#bbcc33")
_SKIP_SCALARS = {"step", "mode", "rewards", "timeline", "decode_segments", "rollout_digest", "rollout_gen_s",
                 "run_started"}


VALIDATION = "validation"  # the "split" of a validation record (nemo_tlt.rl.validation)


def is_validation(record: dict[str, Any]) -> bool:
    return record.get("split") == VALIDATION


def split_records(recs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, validation records), each in the order given."""
    return [r for r in recs if not is_validation(r)], [r for r in recs if is_validation(r)]


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars a record logs: ``<mode>/<key>`` for a step record,
    ``<mode>/validation/<key>`` for a validation record; finite numbers only."""
    prefix = f"{record['mode']}/validation/" if is_validation(record) else f"{record['mode']}/"
    values = {k: v for k, v in record.items() if k not in _SKIP_SCALARS and k != "split"}
    return {prefix + k: v for k, v in finite_scalars(values).items()}


class MetricsWriter:
    """metrics.jsonl + the configured scalar sinks (TensorBoard, W&B, MLflow) for one run
    (rank 0). Takes step records and validation records (``"split": "validation"``).

    ``previous``: a resumed run's step records from its checkpoint; the file is rewritten
    with them, keeping the validation records it held for those steps (so it never holds
    steps the resumed run will redo). ``logger`` unset: TensorBoard only. ``name``: the
    run's name in W&B / MLflow (default: the run folder); ``config``: plain config values
    for them."""

    def __init__(self, out_dir: str | Path, previous: list[dict[str, Any]] = (),
                 logger: LoggerConfig | None = None, name: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        kept = _kept_validation(self.jsonl, previous)
        with open(self.jsonl, "w") as fh:
            for record in _interleave(list(previous), kept):
                fh.write(json.dumps(record) + "\n")
        self.sinks = build_sinks(logger or LoggerConfig(), self.out_dir, name or str(out_dir), config)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.jsonl, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        scalars, step = record_scalars(record), int(record["step"])
        for sink in self.sinks:
            sink.log(scalars, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _kept_validation(path: Path, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validation records of an earlier process's file for the steps in ``previous``."""
    if not previous or not path.is_file():
        return []
    last = max(int(r["step"]) for r in previous)
    return [r for r in read_metrics(path) if is_validation(r) and int(r["step"]) <= last]


def _interleave(steps: list[dict[str, Any]], validation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records with each validation record after the step record of its step."""
    out, pending = [], list(validation)
    for record in steps:
        out.append(record)
        out.extend(v for v in pending if int(v["step"]) == int(record["step"]))
        pending = [v for v in pending if int(v["step"]) != int(record["step"])]
    return out + pending


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_validation(out_dir: str | Path) -> list[dict[str, Any]]:
    """The validation records of a run folder's metrics.jsonl (none if it has no file)."""
    path = Path(out_dir) / "metrics.jsonl"
    return [r for r in read_metrics(path) if is_validation(r)] if path.is_file() else []


def mean_after_first(values: list[float]) -> float:
    """Mean over the steps after the first (all of them when there is only one)."""
    tail = values[1:] if len(values) > 1 else values
    return float(np.mean(tail)) if tail else float("nan")


CONTROL_TOLERANCE = 0.1


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def median_over_pairs(values: list[float]) -> float:
    """The median of per-pair figures (NaN for no pairs)."""
    return float(np.median(values)) if len(values) else float("nan")


def control_is_noisy(control_ratio: float, tolerance: float = CONTROL_TOLERANCE) -> bool:
    """True when the control phase differed by more than `tolerance` between the runs
    (or could not be measured): a speedup from such runs is mostly the machine's."""
    return not (1.0 - tolerance <= control_ratio <= 1.0 + tolerance)


def pair_figures(order: tuple[str, str], tlt: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict:
    """One pair's figures from the step records of its TLT and baseline runs; `order`
    is the order the two ran in, e.g. ("baseline", "tlt")."""
    def mean(recs: list[dict[str, Any]], key: str) -> float:
        return mean_after_first([r[key] for r in recs])

    t_mean, b_mean = mean(tlt, "step_s"), mean(baseline, "step_s")
    t_rollout, b_rollout = mean(tlt, "rollout_s"), mean(baseline, "rollout_s")
    t_update, b_update = mean(tlt, "update_s"), mean(baseline, "update_s")
    # the control: the update's work, identical in both runs; with the pipelined update TLT
    # does part of it inside the rollout, so its work (not its phase) is what compares
    key = "update_work_s" if all("update_work_s" in r for r in tlt + baseline) else "update_s"
    t_work, b_work = mean(tlt, key), mean(baseline, key)
    return {"order": list(order), "tlt_mean_step_s": t_mean, "baseline_mean_step_s": b_mean,
            "speedup": ratio(b_mean, t_mean), "step_time_ratio": ratio(t_mean, b_mean),
            "rollout_speedup": ratio(b_rollout, t_rollout), "baseline_rollout_share": ratio(b_rollout, b_mean),
            "tlt_update_s": t_update, "baseline_update_s": b_update, "tlt_update_work_s": t_work,
            "baseline_update_work_s": b_work, "control_ratio": ratio(b_work, t_work)}


def summarize_pairs(pairs: list[dict[str, Any]], tolerance: float = CONTROL_TOLERANCE) -> dict[str, Any]:
    """Medians over pairs of the per-pair figures (``pair_figures``), the noisy flag and its note."""
    def med(key: str) -> float:
        return median_over_pairs([p[key] for p in pairs])

    control = med("control_ratio")
    noisy = control_is_noisy(control, tolerance)
    note = None
    if noisy:
        note = (f"the machine was too noisy for the speedup to mean much: the policy update's work, the same in "
                f"both runs, took {control:.2f}x as long in the baseline runs as in the TLT runs (median over "
                f"{len(pairs)} pair(s); outside [{1 - tolerance:.2f}, {1 + tolerance:.2f}])")
    return {"speedup": med("speedup"), "step_time_ratio": med("step_time_ratio"),
            "rollout_speedup": med("rollout_speedup"), "baseline_rollout_share": med("baseline_rollout_share"),
            # the phase split: update time left after the rollout, and the update's whole work
            "tlt_update_s": med("tlt_update_s"), "baseline_update_s": med("baseline_update_s"),
            "tlt_update_work_s": med("tlt_update_work_s"), "baseline_update_work_s": med("baseline_update_work_s"),
            "control_ratio": control, "noisy": noisy, "note": note}


def all_identical(values: list[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


def run_block(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's entry in report.json (see nemo_tlt.rl.loop.RLWorker.run for `summary`)."""
    recs = summary["records"]
    steps = [r["step_s"] for r in recs]
    return {"mode": summary["mode"], "step_times": steps, "mean_step_s_after_first": mean_after_first(steps),
            "wall_s": summary["wall_s"], "status": summary["status"], "out_dir": summary["out_dir"],
            "reward_mean": [r["reward_mean"] for r in recs],
            "rollout_s": [r["rollout_s"] for r in recs],
            "update_s": [r["update_s"] for r in recs],
            "mean_accept_len": [r["mean_accept_len"] for r in recs],
            "drafter_samples": [r["drafter_samples"] for r in recs],
            "drafter_train_s": [r["drafter_train_s"] for r in recs]}


def compare_pairs(pairs: list[tuple[tuple[str, str], dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """report.json figures from completed pairs of (order, TLT summary, baseline summary)."""
    per_pair = [pair_figures(order, t["records"], b["records"]) for order, t, b in pairs]
    runs = [s for _, t, b in pairs for s in (t, b)]
    return {
        **summarize_pairs(per_pair),
        "pairs": per_pair,
        "rewards_identical": all_identical([[r["rewards"] for r in s["records"]] for s in runs]),
        "rollouts_identical": all_identical([[r["rollout_digest"] for r in s["records"]] for s in runs]),
        # the policy each run ends with (records without the digest: None)
        "final_policy_identical": all_identical([s["records"][-1].get("policy_digest") if s["records"] else None
                                                 for s in runs]),
        "steps_compared": min(len(s["records"]) for s in runs) if runs else 0,
    }


def format_pairs(report: dict[str, Any]) -> str:
    """The per-pair table printed at the end of a comparison (``compare_pairs``' output)."""
    lines = [f"{'pair':<6}{'order':<16}{'TLT s/step':>11}{'base s/step':>12}{'speedup':>9}{'update b/t':>12}"]
    for k, p in enumerate(report["pairs"], 1):
        lines.append(f"{k:<6}{', '.join(p['order']):<16}{p['tlt_mean_step_s']:>11.2f}"
                     f"{p['baseline_mean_step_s']:>12.2f}{p['speedup']:>8.2f}x{p['control_ratio']:>12.2f}")
    lines.append(f"{'median':<6}{'':<16}{'':>11}{'':>12}{report['speedup']:>8.2f}x{report['control_ratio']:>12.2f}")
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rewards(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    styles = {"tlt": dict(marker="o", lw=2.5), "baseline": dict(marker="x", ls="--", lw=1.5)}
    for name, recs in runs.items():
        ax.plot([r["step"] for r in recs], [r["reward_mean"] for r in recs], label=name,
                **styles.get(name.split()[0], {}))
    ax.set_xlabel("RL step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean reward")
    ax.set_title("reward vs step")
    ax.legend()
    return _save(fig, path)


def plot_step_breakdown(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    # two runs a row: with pairs, one pair a row
    cols = min(len(runs), 2)
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, (name, recs) in zip(axes.flat, runs.items()):
        steps = np.array([r["step"] for r in recs])
        bottom = np.zeros(len(recs))
        for key, label in BREAKDOWN:
            values = np.array([max(r[key], 0.0) for r in recs])
            ax.bar(steps - 0.18, values, width=0.36, bottom=bottom, label=label)
            bottom += values
        ax.bar(steps + 0.18, [r["drafter_train_s"] for r in recs], width=0.36, color="#ee7733", hatch="//",
               alpha=0.6, label="drafter training\n(worker-s, in idle time)")
        ax.set_title(f"{name}: step time")
        ax.set_xlabel("RL step")
        ax.set_xticks(steps)
    for row in axes:
        row[0].set_ylabel("seconds")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    return _save(fig, path)


def plot_accept_length(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, recs in runs.items():
        if any(r["sd_steps"] for r in recs):
            ax.plot([r["step"] for r in recs], [r["mean_accept_len"] for r in recs], marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean accepted tokens / verify")
    ax.set_title("speculative decoding: accepted length per step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _save(fig, path)


def process_runs(recs: list[dict]) -> list[tuple[float, list[dict]]]:
    """The records split by the process that produced them, each with the seconds to add
    to its times. A resumed run (after a stop or a requeue) times its steps from its own
    start (``run_started`` differs; in records without it, its first step ends before the
    step logged before it); its times are shifted to continue where the previous
    process's last step ended (the time between the two processes is left out)."""
    parts: list[tuple[float, list[dict]]] = []
    offset, prev = 0.0, None
    for r in recs:
        if prev is None or _new_process(prev, r):
            if prev is not None:
                offset += prev["t_end"]
            parts.append((offset, []))
        parts[-1][1].append(r)
        prev = r
    return parts


def _new_process(prev: dict, rec: dict) -> bool:
    if "run_started" in prev and "run_started" in rec:
        return rec["run_started"] != prev["run_started"]
    return rec["t_end"] < prev["t_end"]


def resume_times(recs: list[dict]) -> list[float]:
    """Where, on the shifted time axis of ``process_runs``, a resumed process took over."""
    return [offset for offset, _ in process_runs(recs)[1:]]


def timeline_segments(recs: list[dict]) -> dict[int, list[tuple[float, float, str]]]:
    """Per rank: (start, end, state) segments over the whole run from the step records
    (a resumed run's after its predecessor's: ``process_runs``)."""
    out: dict[int, list[tuple[float, float, str]]] = {}
    for offset, part in process_runs(recs):
        events: dict[int, list[tuple[float, str]]] = {}
        for r in part:
            for rank, state, t in r["timeline"]:
                events.setdefault(int(rank), []).append((offset + float(t), state))
        end = offset + part[-1]["t_end"]
        for rank, evs in events.items():
            evs.sort()
            out.setdefault(rank, []).extend(
                (t, (evs[i + 1][0] if i + 1 < len(evs) else end), s) for i, (t, s) in enumerate(evs))
    return out


def decode_strips(recs: list[dict]) -> dict[int, list[tuple[float, float, str]]]:
    """Per rank: (start, end, choice) decode segments over the whole run ("plain" or a
    tree shape's name); records without ``decode_segments`` contribute none."""
    out: dict[int, list[tuple[float, float, str]]] = {}
    for offset, part in process_runs(recs):
        for r in part:
            for rank, a, b, choice in r.get("decode_segments", []):
                out.setdefault(int(rank), []).append((offset + float(a), offset + float(b), str(choice)))
    return out


def worker_labels(recs: list[dict]) -> dict[int, str]:
    """A row label per rank: "worker k", with its node when the run spanned several
    nodes (the records' ``rank_nodes``)."""
    ranks = sorted({int(rank) for r in recs for rank, _, _ in r["timeline"]})
    nodes = next((r["rank_nodes"] for r in reversed(recs) if "rank_nodes" in r), None)
    if nodes is None or len(set(nodes)) < 2:
        return {k: f"worker {k}" for k in ranks}
    return {k: f"worker {k} (node {nodes[k]})" if k < len(nodes) else f"worker {k}" for k in ranks}


def decode_colors(runs: dict[str, list[dict]]) -> dict[str, str]:
    """One colour per decode choice over all runs (the same shape: the same colour), and one
    for the pipelined update's "update" segments when there are any."""
    choices = {c for recs in runs.values() for items in decode_strips(recs).values() for _, _, c in items}
    shapes = sorted(choices - {"plain", "update"})
    update = {"update": UPDATE_COLOR} if "update" in choices else {}  # the pipelined update's group gradients
    return {"plain": PLAIN_COLOR, **update, **{s: SHAPE_COLORS[i % len(SHAPE_COLORS)] for i, s in enumerate(shapes)}}


def _strip_label(choice: str) -> str:
    if choice == "update":
        return "policy update (pipelined)"
    return "decode: plain" if choice == "plain" else f"decode: SD {choice}"


def plot_worker_timeline(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    from matplotlib.patches import Patch
    colors = decode_colors(runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 + 1.0 * len(runs) * 2), squeeze=False)
    for ax, (name, recs) in zip(axes[:, 0], runs.items()):
        segs = timeline_segments(recs)
        for rank, items in segs.items():
            for state in STATE_COLORS:
                bars = [(a, b - a) for a, b, s in items if s == state and b > a]
                ax.broken_barh(bars, (rank - 0.4, 0.8), color=STATE_COLORS[state])
        # inside the BUSY rollout time: a strip of how each stretch was decoded
        for rank, items in decode_strips(recs).items():
            for choice, color in colors.items():
                bars = [(a, b - a) for a, b, c in items if c == choice and b > a]
                ax.broken_barh(bars, (rank - 0.4, 0.28), color=color, lw=0)
        for offset, part in process_runs(recs):
            for r in part:
                ax.axvline(offset + r["t_end"], color="k", lw=0.5, ls=":")
        resumed = resume_times(recs)
        for t in resumed:
            ax.axvline(t, color="#cc3311", lw=1.5, ls="--")
        labels = worker_labels(recs)
        ax.set_yticks(sorted(segs))
        ax.set_yticklabels([labels.get(k, f"worker {k}") for k in sorted(segs)])
        note = "; red: resumed" if resumed else ""
        ax.set_title(f"{name}: worker states, lower strip: how the rollout decoded and where the pipelined update "
                     f"ran (dotted: end of an RL step"
                     f"{note})", fontsize=9)
        ax.set_xlabel("seconds since the run started")
    handles = [Patch(color=c, label=s.upper()) for s, c in STATE_COLORS.items()]
    handles += [Patch(color=c, label=_strip_label(s))
                for s, c in colors.items()]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 7), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return _save(fig, path, layout=False)


def _save(fig, path: str | Path, layout: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def plot_validation(runs: dict[str, list[dict]], path: str | Path) -> Path:
    """Validation curves: mean reward, and accuracy where the reward defines it, vs step."""
    plt = _plt()
    has_accuracy = any("accuracy" in r for recs in runs.values() for r in recs)
    panels = [("mean_reward", "mean reward")] + ([("accuracy", "accuracy")] if has_accuracy else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name, recs in runs.items():
            pts = [(r["step"], r[key]) for r in recs if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("RL step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(label)
        ax.set_title(f"validation: {label}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return _save(fig, path)


def write_plots(runs: dict[str, list[dict]], out_dir: str | Path,
                validation: dict[str, list[dict]] | None = None) -> dict[str, str]:
    """The PNG plots of ``runs`` (name -> records). Validation records may come mixed into
    a run's records (``"split": "validation"``) or in ``validation`` (name -> records, e.g.
    ``read_validation(run folder)``); with any, ``validation_vs_step.png`` is drawn too."""
    out = Path(out_dir)
    steps = {name: split_records(recs)[0] for name, recs in runs.items()}
    checks = {name: split_records(recs)[1] + list((validation or {}).get(name, [])) for name, recs in runs.items()}
    steps = {name: recs for name, recs in steps.items() if recs}
    plots = {
        "reward_vs_step": str(plot_rewards(steps, out / "reward_vs_step.png")),
        "step_time_breakdown": str(plot_step_breakdown(steps, out / "step_time_breakdown.png")),
        "accept_length": str(plot_accept_length(steps, out / "accept_length.png")),
        "worker_timeline": str(plot_worker_timeline(steps, out / "worker_timeline.png")),
    }
    checks = {name: sorted(recs, key=lambda r: r["step"]) for name, recs in checks.items() if recs}
    if checks:
        plots["validation_vs_step"] = str(plot_validation(checks, out / "validation_vs_step.png"))
    return plots


def progress_bar(cfg, mode: str, start: int):
    """A tqdm bar over the run's RL steps (None with ``progress: false``)."""
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=start, desc=f"RL steps ({mode})", unit="step", leave=True)
