"""PNG plots of a run's step records (``nemo_tlt.rl.reporting.report`` writes the records and the
TLT-vs-baseline report; the loop produces the records).

Contract: every run given (``write_plots``; with ``--compare-baseline`` every run of every
pair): reward vs step, step-time breakdown (rollout / log-prob / update / weight sync /
other, with drafter-training worker-seconds beside it), accepted length per step, worker
timeline (BUSY / IDLE / TRAINING per worker, with a strip inside the BUSY rollout time
showing where the worker decoded plainly and where with SD, per tree shape, from the
records' ``decode_segments``, and the pipelined update's pieces); rows name their node when
the run spanned several (``rank_nodes``); a resumed run's steps follow its predecessor's,
with a mark where it took over (``process_runs``). Validation records, mixed in or given
apart, make a validation curve (``validation_vs_step.png``). Plots read step records only.
With ``--compare-baseline``, ``plot_reward_curves`` draws the report's ``reward_curves``
(mean reward per step of each mode over its prompt groups, the mode's runs averaged within
a group, with the shaded 95% interval; the TLT - baseline difference, paired by prompt group,
and its interval in the title): ``reward_curves.png``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nemo_tlt.rl.reporting.report import split_records

BREAKDOWN = (("rollout_s", "rollout"), ("logprob_s", "log-prob"), ("update_s", "update"),
             ("weight_sync_s", "weight sync"), ("other_s", "other"))
STATE_COLORS = {"busy": "#4477aa", "idle": "#dddddd", "training": "#ee7733"}
# decode strips: plain dark, SD shapes in colours the worker states do not use
PLAIN_COLOR = "#333333"
UPDATE_COLOR = "#ee3377"  # the pipelined update's group gradients, in the strip beside the decoding
SHAPE_COLORS = ("#44bb99", "#aa3377", "#ccbb44", "#99ddff", "#882255", "#bbcc33")


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


def plot_reward_curves(curves: dict, path: str | Path) -> Path:
    """One line per mode of ``nemo_tlt.rl.reporting.report.reward_curves``' output with its shaded
    95% interval; the title gives ``reward_difference`` when present."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    styles = {"tlt": dict(marker="o", lw=2.5, color="#4477aa"),
              "baseline": dict(marker="x", ls="--", lw=1.5, color="#ee7733")}
    for mode in ("tlt", "baseline"):
        curve = curves.get(mode)
        if not curve or not curve["steps"]:
            continue
        style = styles[mode]
        label = f"{mode} ({max(curve['runs'])} run(s), {max(curve['prompts'])} prompts/step)"
        ax.plot(curve["steps"], curve["mean"], label=label, **style)
        ax.fill_between(curve["steps"], curve["low"], curve["high"], color=style["color"], alpha=0.2, lw=0)
    ax.set_xlabel("RL step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean reward (95% interval)")
    diff = curves.get("reward_difference")
    title = "reward vs step by prompt group, runs averaged"
    if diff:
        title += (f"\nTLT - baseline {diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] "
                  f"over {diff['cells']} (step, prompt) cells")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
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
