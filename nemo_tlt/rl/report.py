"""Run reports: metrics JSONL + TensorBoard while a run goes, PNG plots and the
TLT-vs-baseline ``report.json`` after it.

Contract
--------
* ``MetricsWriter`` (rank 0 only) appends one JSON object per RL step to
  ``<run>/metrics.jsonl`` and the numeric fields as TensorBoard scalars under
  ``<run>/tb``. On resume it rewrites the JSONL from the checkpoint's records, so the
  file never holds steps the resumed run will redo.
* Plots read step records only (the dicts ``nemo_tlt.rl.loop`` produces):
  reward vs step (every run given), step-time breakdown (rollout / log-prob /
  update / weight sync / other, with drafter-training worker-seconds beside it),
  accepted length per step, worker timeline (BUSY / IDLE / TRAINING per worker).
* ``compare`` computes the figures of ``report.json``; the speedup is the ratio of
  mean step times over the steps after the first (the first pays one-time warm-up).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

BREAKDOWN = (("rollout_s", "rollout"), ("logprob_s", "log-prob"), ("update_s", "update"),
             ("weight_sync_s", "weight sync"), ("other_s", "other"))
STATE_COLORS = {"busy": "#4477aa", "idle": "#dddddd", "training": "#ee7733"}
_SKIP_SCALARS = {"step", "mode", "rewards", "timeline", "rollout_digest", "rollout_gen_s"}


class MetricsWriter:
    """metrics.jsonl + TensorBoard scalars for one run (rank 0)."""

    def __init__(self, out_dir: str | Path, previous: list[dict[str, Any]] = ()) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        with open(self.jsonl, "w") as fh:
            for record in previous:
                fh.write(json.dumps(record) + "\n")
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only where a run logs
        self.tb = SummaryWriter(log_dir=str(self.out_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.jsonl, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        step = int(record["step"])
        for key, value in record.items():
            if key in _SKIP_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.tb.add_scalar(f"{record['mode']}/{key}", value, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def mean_after_first(values: list[float]) -> float:
    """Mean over the steps after the first (all of them when there is only one)."""
    tail = values[1:] if len(values) > 1 else values
    return float(np.mean(tail)) if tail else float("nan")


def compare(tlt: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """report.json figures from the two runs' summaries (see nemo_tlt.rl.loop.RLWorker.run)."""
    t_steps = [r["step_s"] for r in tlt["records"]]
    b_steps = [r["step_s"] for r in baseline["records"]]
    t_mean, b_mean = mean_after_first(t_steps), mean_after_first(b_steps)
    b_rollout = mean_after_first([r["rollout_s"] for r in baseline["records"]])
    t_rollout = mean_after_first([r["rollout_s"] for r in tlt["records"]])
    rewards_t = [r["rewards"] for r in tlt["records"]]
    rewards_b = [r["rewards"] for r in baseline["records"]]
    digests_t = [r["rollout_digest"] for r in tlt["records"]]
    digests_b = [r["rollout_digest"] for r in baseline["records"]]

    def run_block(summary: dict[str, Any], steps: list[float]) -> dict[str, Any]:
        recs = summary["records"]
        return {"step_times": steps, "mean_step_s_after_first": mean_after_first(steps),
                "wall_s": summary["wall_s"], "status": summary["status"], "out_dir": summary["out_dir"],
                "reward_mean": [r["reward_mean"] for r in recs],
                "rollout_s": [r["rollout_s"] for r in recs],
                "mean_accept_len": [r["mean_accept_len"] for r in recs],
                "drafter_samples": [r["drafter_samples"] for r in recs],
                "drafter_train_s": [r["drafter_train_s"] for r in recs]}

    return {
        "tlt": run_block(tlt, t_steps),
        "baseline": run_block(baseline, b_steps),
        "speedup": b_mean / t_mean if t_mean > 0 else float("nan"),
        "step_time_ratio": t_mean / b_mean if b_mean > 0 else float("nan"),
        "rollout_speedup": b_rollout / t_rollout if t_rollout > 0 else float("nan"),
        "baseline_rollout_share": b_rollout / b_mean if b_mean > 0 else float("nan"),
        "rewards_identical": rewards_t == rewards_b,
        "rollouts_identical": digests_t == digests_b,
        "steps_compared": min(len(t_steps), len(b_steps)),
    }


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
                **styles.get(name, {}))
    ax.set_xlabel("RL step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean reward")
    ax.set_title("reward vs step")
    ax.legend()
    return _save(fig, path)


def plot_step_breakdown(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, (name, recs) in zip(axes[0], runs.items()):
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
    axes[0][0].set_ylabel("seconds")
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


def timeline_segments(recs: list[dict]) -> dict[int, list[tuple[float, float, str]]]:
    """Per rank: (start, end, state) segments over the whole run from the step records."""
    events: dict[int, list[tuple[float, str]]] = {}
    for r in recs:
        for rank, state, t in r["timeline"]:
            events.setdefault(int(rank), []).append((float(t), state))
    end = recs[-1]["t_end"] if recs else 0.0
    out = {}
    for rank, evs in events.items():
        evs.sort()
        out[rank] = [(t, (evs[i + 1][0] if i + 1 < len(evs) else end), s) for i, (t, s) in enumerate(evs)]
    return out


def plot_worker_timeline(runs: dict[str, list[dict]], path: str | Path) -> Path:
    plt = _plt()
    from matplotlib.patches import Patch
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 1.0 * len(runs) * 2), squeeze=False)
    for ax, (name, recs) in zip(axes[:, 0], runs.items()):
        segs = timeline_segments(recs)
        for rank, items in segs.items():
            for state in STATE_COLORS:
                bars = [(a, b - a) for a, b, s in items if s == state and b > a]
                ax.broken_barh(bars, (rank - 0.4, 0.8), color=STATE_COLORS[state])
        for r in recs:
            ax.axvline(r["t_end"], color="k", lw=0.5, ls=":")
        ax.set_yticks(sorted(segs))
        ax.set_yticklabels([f"worker {k}" for k in sorted(segs)])
        ax.set_title(f"{name}: worker states (dotted: end of an RL step)")
        ax.set_xlabel("seconds since the run started")
    axes[0][0].legend(handles=[Patch(color=c, label=s.upper()) for s, c in STATE_COLORS.items()],
                      loc="upper right", fontsize=7)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def write_plots(runs: dict[str, list[dict]], out_dir: str | Path) -> dict[str, str]:
    out = Path(out_dir)
    return {
        "reward_vs_step": str(plot_rewards(runs, out / "reward_vs_step.png")),
        "step_time_breakdown": str(plot_step_breakdown(runs, out / "step_time_breakdown.png")),
        "accept_length": str(plot_accept_length(runs, out / "accept_length.png")),
        "worker_timeline": str(plot_worker_timeline(runs, out / "worker_timeline.png")),
    }
