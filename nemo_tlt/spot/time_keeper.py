"""The job's time limit, as the RL loop and the idle-time trainer need it.

Contract
--------
* ``TimeKeeper(deadline, margin_s)``: ``deadline`` is the wall-clock time (seconds
  since the epoch) the job is killed at, or None (no limit). ``time_left()`` is the
  seconds until ``deadline - margin_s`` (None without a limit); ``can_finish(s)`` says
  whether work expected to take ``s`` seconds ends before it. The margin covers what
  must still happen after the last unit of work: the final checkpoint, process exit.
* ``from_slurm(env, margin_s)`` reads the limit of the SLURM job in ``env``: the end
  time from ``SLURM_JOB_END_TIME`` when SLURM exports it, otherwise ``squeue -h -j
  $SLURM_JOB_ID -o %L`` (time left, ``[days-]hh:mm:ss``, ``mm:ss`` or ``UNLIMITED``),
  queried once and turned into a deadline, so nothing polls SLURM per step.
  Outside a SLURM job it returns a keeper without a limit. ``refresh()`` re-reads it
  (a job whose limit was changed with ``scontrol update``).
* ``StepBudget`` estimates what the next RL step costs from the steps seen so far (the
  longest of the last few, plus the checkpoint write), so the loop starts no step that
  cannot end, with its checkpoint, before the limit.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import deque
from typing import Callable, Mapping

_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_slurm_duration(text: str) -> float | None:
    """Seconds of a SLURM duration (``squeue %L``); None for UNLIMITED / NOT_SET / INVALID."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "NOT_SET", "INVALID", ""):
        return None
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"not a SLURM duration ([days-]hh:mm:ss, mm:ss or UNLIMITED): {text!r}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def squeue_time_left(job_id: str, run: Callable = subprocess.run) -> float | None:
    """Time left of job ``job_id`` by ``squeue`` (None: unlimited)."""
    if shutil.which("squeue") is None and run is subprocess.run:
        raise RuntimeError("squeue is not on PATH: cannot read the SLURM job's time limit")
    out = run(["squeue", "-h", "-j", str(job_id), "-o", "%L"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"squeue -j {job_id} -o %L failed (exit {out.returncode}): {out.stderr.strip()}")
    return parse_slurm_duration(out.stdout.splitlines()[0])


class TimeKeeper:
    def __init__(self, deadline: float | None, margin_s: float = 60.0,
                 clock: Callable[[], float] = time.time, reader: Callable[[], float | None] | None = None) -> None:
        if margin_s < 0:
            raise ValueError(f"TimeKeeper.margin_s must be >= 0, got {margin_s!r}")
        self.deadline, self.margin_s, self.clock, self._reader = deadline, float(margin_s), clock, reader

    @classmethod
    def from_slurm(cls, env: Mapping[str, str] | None = None, margin_s: float = 60.0,
                   clock: Callable[[], float] = time.time, run: Callable = subprocess.run) -> "TimeKeeper":
        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID")
        if not job:
            return cls(None, margin_s, clock)

        def read() -> float | None:
            end = env.get("SLURM_JOB_END_TIME")
            if end:
                return float(end)
            left = squeue_time_left(job, run)
            return None if left is None else clock() + left

        return cls(read(), margin_s, clock, read)

    def refresh(self) -> None:
        if self._reader is not None:
            self.deadline = self._reader()

    def time_left(self) -> float | None:
        """Seconds until the deadline minus the margin (None: no limit; may be negative)."""
        return None if self.deadline is None else self.deadline - self.margin_s - self.clock()

    def can_finish(self, seconds: float) -> bool:
        left = self.time_left()
        return left is None or seconds <= left


class StepBudget:
    """What the next RL step is expected to cost: the longest of the last ``window`` steps
    plus the slowest checkpoint write seen (0 before any step: the first always runs)."""

    def __init__(self, window: int = 4) -> None:
        self._steps: deque[float] = deque(maxlen=window)
        self._checkpoint_s = 0.0

    def add_step(self, seconds: float) -> None:
        self._steps.append(float(seconds))

    def add_checkpoint(self, seconds: float) -> None:
        self._checkpoint_s = max(self._checkpoint_s, float(seconds))

    def next_step_s(self) -> float:
        return (max(self._steps) if self._steps else 0.0) + self._checkpoint_s
