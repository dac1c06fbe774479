"""The simulated step timeline as a PNG: per rollout replica, plain decoding, SD (by arm) and
idle / drafter-training time, then the training phases; baseline above, TLT below."""
from __future__ import annotations

import os
from pathlib import Path

from nemo_tlt.plan.simulator import FixedCosts, StepResult


def plot_step(results: dict[str, StepResult], fixed: dict[str, float], path: str | os.PathLike) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({lbl for r in results.values() for tr in r.traces for *_, lbl in tr if lbl not in ("", "prefill")})
    cmap = plt.get_cmap("tab10")
    colour = {"": (0.6, 0.6, 0.6), "prefill": (0.3, 0.3, 0.3), **{a: cmap(i % 10) for i, a in enumerate(arms)}}
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.2 + 0.25 * len(next(iter(results.values())).traces)
                                                        * len(results)), sharex=True, squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        for y, trace in enumerate(res.traces):
            for start, seconds, _, label in trace:
                ax.broken_barh([(start, seconds)], (y - 0.4, 0.8), color=colour[label])
            end = res.replica_s[y]
            idle_colour = "#aa3377" if res.trained_gpu_s > 0 else "#dddddd"
            ax.broken_barh([(end, res.rollout_s - end)], (y - 0.4, 0.8), color=idle_colour)
        t = res.rollout_s
        for phase, seconds in fixed.items():
            ax.broken_barh([(t, seconds)], (-0.4, len(res.traces) - 0.2), color="#4477aa", alpha=0.3)
            t += seconds
        ax.set_ylabel("replica")
        ax.set_title(f"{name}: step {res.step_s:.1f} s, rollout {res.rollout_s:.1f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in ["", *arms]]
    handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#dddddd", "#aa3377", "#4477aa")]
    fig.legend(handles, ["plain", *[f"SD {a}" for a in arms], "idle", "drafter training", "log-prob/update/sync"],
               loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


__all__ = ["plot_step", "FixedCosts"]
