"""The rollout timeline plot: running sequences over time, SD on/off, chosen arm."""
from __future__ import annotations

import os
from pathlib import Path

from nemo_tlt.rollout.protocol import StepTrace


def plot_rollout_timeline(traces: dict[str, list[StepTrace]], path: str | os.PathLike,
                          title: str = "Rollout timeline") -> Path:
    """One panel per method: running sequences vs elapsed seconds; plain steps grey,
    SD steps coloured by tree shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({t.shape for tr in traces.values() for t in tr if t.shape})
    cmap = plt.get_cmap("tab10")
    colour = {s: cmap(i % 10) for i, s in enumerate(shapes)}
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.2 * len(traces) + 0.6), sharex=True, squeeze=False)
    for ax, (name, trace) in zip(axes[:, 0], traces.items()):
        t = 0.0
        for step in trace:
            c = colour[step.shape] if step.shape else (0.6, 0.6, 0.6)
            ax.bar(t, step.running, width=step.seconds, align="edge", color=c, linewidth=0)
            t += step.seconds
        ax.set_ylabel("running")
        ax.set_title(f"{name}: {t:.2f} s", fontsize=9, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=(0.6, 0.6, 0.6))] + [plt.Rectangle((0, 0), 1, 1, color=colour[s])
                                                                     for s in shapes]
    fig.legend(handles, ["plain"] + [f"SD {s}" for s in shapes], loc="upper right", fontsize=8, ncol=4)
    axes[-1, 0].set_xlabel("seconds since start of rollout")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
