"""The job's time limit: SLURM durations, the deadline from SLURM's environment or squeue,
and the rule that no step starts which cannot end (with its checkpoint) before it."""
import subprocess

import pytest

from nemo_tlt.spot.time_keeper import StepBudget, TimeKeeper, parse_slurm_duration


@pytest.mark.parametrize("text, seconds", [("1-02:03:04", 93784.0), ("02:03:04", 7384.0), ("03:04", 184.0),
                                           ("0:05", 5.0), ("UNLIMITED", None), ("NOT_SET", None)])
def test_slurm_durations(text, seconds):
    assert parse_slurm_duration(text) == seconds


def test_a_malformed_duration_is_refused():
    with pytest.raises(ValueError, match="not a SLURM duration"):
        parse_slurm_duration("5 minutes")


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_deadline_from_end_time_and_margin():
    clock = Clock()
    keeper = TimeKeeper.from_slurm({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1300"}, margin_s=60, clock=clock)
    assert keeper.time_left() == 240.0
    assert keeper.can_finish(240.0) and not keeper.can_finish(241.0)
    clock.t = 1250.0
    assert keeper.time_left() == -10.0 and not keeper.can_finish(0.0)


def test_deadline_from_squeue_is_read_once():
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="00:02:00\n", stderr="")

    clock = Clock()
    keeper = TimeKeeper.from_slurm({"SLURM_JOB_ID": "42"}, margin_s=30, clock=clock, run=run)
    assert calls == [["squeue", "-h", "-j", "42", "-o", "%L"]]
    clock.t += 60
    assert keeper.time_left() == 30.0 and len(calls) == 1  # no query per step
    keeper.refresh()
    assert len(calls) == 2


def test_no_job_or_unlimited_means_no_limit():
    assert TimeKeeper.from_slurm({}).time_left() is None
    unlimited = TimeKeeper.from_slurm({"SLURM_JOB_ID": "1"}, run=lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout="UNLIMITED\n", stderr=""))
    assert unlimited.time_left() is None and unlimited.can_finish(1e9)


def test_a_failing_squeue_is_an_error_not_a_guess():
    with pytest.raises(RuntimeError, match="squeue -j 9 -o %L failed"):
        TimeKeeper.from_slurm({"SLURM_JOB_ID": "9"}, run=lambda cmd, **kw: subprocess.CompletedProcess(
            cmd, 1, stdout="", stderr="slurm_load_jobs error: Invalid job id specified"))


def test_step_budget_is_the_longest_recent_step_plus_the_checkpoint():
    budget = StepBudget(window=2)
    assert budget.next_step_s() == 0.0
    for s in (5.0, 9.0, 6.0):
        budget.add_step(s)
    budget.add_checkpoint(1.5)
    budget.add_checkpoint(0.5)
    assert budget.next_step_s() == 10.5  # the last 2 steps (9, 6) and the slowest checkpoint
    budget.add_step(4.0)
    assert budget.next_step_s() == 7.5  # 9 has left the window
