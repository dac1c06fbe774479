"""What every rank agrees on between two RL steps: stop, or go, and how.

At each step boundary one collective decides, on every rank alike:
* ``stop``: a stop was requested on some rank (SIGINT / SIGTERM, SLURM's USR1 before
  preemption or the time limit);
* ``out_of_time``: under a job time limit, the next step (the longest recent one plus
  its checkpoint: :class:`~nemo_tlt.spot.time_keeper.StepBudget`) cannot end before the
  limit minus ``workers.time_limit_margin_s``: the run checkpoints and stops now rather
  than be killed mid-step or mid-write;
* ``tight``: it fits, but not twice over: its idle-time drafter round is skipped, so
  the step ends as soon as its rollout and update do.
Rank 0 keeps the time (one ``squeue`` query per run at most); the others follow it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nemo_tlt.spot.time_keeper import StepBudget, TimeKeeper

if TYPE_CHECKING:
    from nemo_tlt.dist import Comm, StopFlag


@dataclass(frozen=True)
class Decision:
    stop: bool
    out_of_time: bool
    tight: bool


class StepBoundary:
    def __init__(self, comm: "Comm", stop: "StopFlag", margin_s: float) -> None:
        self.comm, self.stop = comm, stop
        self.keeper = TimeKeeper.from_slurm(margin_s=margin_s) if comm.rank == 0 else None
        self.budget = StepBudget()

    def decide(self) -> Decision:
        keeper, need = self.keeper, self.budget.next_step_s()
        out_of_time = keeper is not None and not keeper.can_finish(need)
        tight = keeper is not None and not keeper.can_finish(2 * need)
        flags = self.comm.sum_(torch.tensor([float(self.stop.requested), float(out_of_time), float(tight)],
                                            device="cpu"))  # coordination: gloo
        return Decision(bool(flags[0] > 0), bool(flags[1] > 0), bool(flags[2] > 0))

    def time_left(self) -> float | None:
        return None if self.keeper is None else self.keeper.time_left()

    def reason(self, decision: Decision) -> str:
        if decision.stop:
            return "interrupted"
        return (f"stopped before the job's time limit ({self.time_left():.0f} s left beyond the margin, "
                f"the next step needs about {self.budget.next_step_s():.0f} s)")
