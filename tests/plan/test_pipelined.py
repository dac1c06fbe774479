"""The pipelined update (a modelled design): work on finished groups runs on idle replicas
during the tail. The planner's overlap is checked against an event simulation of the
workers written here, independently of the simulator's formula; a step loses exactly the
overlapped work and equals the plain step when nothing can overlap; the chosen share is
the fastest, and where pipelining pays it is not the trivial 0."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from nemo_tlt.plan.simulator import SHARES, LengthModel, group_work, pipelined_overlap, recommend_share, simulate

from test_simulator import COSTS, FIXED, sim


def event_overlap(finish: list[np.ndarray], work: list[list[float]], group: int, share: float = 1.0) -> float:
    """Seconds of update work (in seconds of the whole cluster) done before the last worker
    ends, simulated worker by worker.

    ``finish[w]``: when each row of worker w finished; its rows form groups of ``group``
    consecutive rows and a group becomes trainable when its last row has finished.
    ``work[w][g]``: that group's work in cluster-seconds, so one worker needs ``workers``
    times as long. A worker is idle from its last row on and gives ``share`` of its time to
    the update: idle workers take the trainable groups with work left, oldest first, one
    each (more idle workers than groups: they split groups, as the RL loop's micro-batch
    pieces do). Workers are assigned afresh whenever a worker goes idle, a group becomes
    trainable or a group's work is used up."""
    n = len(finish)
    ends = [float(np.max(f)) for f in finish]
    last = max(ends)
    groups = sorted(([float(np.max(f[g * group:(g + 1) * group])), n * w_g]
                     for f, ws in zip(finish, work) for g, w_g in enumerate(ws)), key=lambda g: g[0])
    t, done = 0.0, 0.0
    while t < last:
        idle = sum(e <= t for e in ends)
        ready = [g for g in groups if g[0] <= t and g[1] > 0.0]
        rate = [0.0] * len(ready)
        for i in range(idle if ready else 0):
            rate[i % len(ready)] += share
        nxt = [g[0] for g in groups if g[0] > t] + [e for e in ends if e > t] + [last]
        nxt += [t + g[1] / r for g, r in zip(ready, rate) if r > 0.0]
        t1 = min(nxt)
        for g, r in zip(ready, rate):
            if r > 0.0:
                used = g[1] if t + g[1] / r <= t1 else r * (t1 - t)
                g[1] -= used
                done += used
        t = t1
    return done / n


def test_overlap_by_hand():
    # replica 0 idle from t=1, replica 1 runs to t=3; half the work finished at t=1
    groups, ends = [(1.0, 0.5), (3.0, 0.5)], [1.0, 3.0]
    assert pipelined_overlap(groups, ends, 1.0) == pytest.approx(0.5)      # capacity 1/2 x 2 s, capped by work
    assert pipelined_overlap(groups, ends, 1.0, share=0.25) == pytest.approx(0.25)
    assert pipelined_overlap([(3.0, 1.0)], ends, 1.0) == 0.0               # nothing finished before the end
    assert pipelined_overlap([(1.0, 1.0)], [1.0, 1.0], 1.0) == 0.0          # nobody idle before the end


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("seed", range(8))
def test_overlap_matches_an_event_simulation_of_the_workers(seed, share):
    """Workers finish rows at random times (each at its own pace); the planner's overlap
    (``group_work`` then ``pipelined_overlap``) is the event simulation's."""
    rng = np.random.default_rng(seed)
    workers, group, per = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    lengths = [rng.integers(1, 300, size=group * per) for _ in range(workers)]
    finish = [0.5 + ls * rng.uniform(0.002, 0.02) for ls in lengths]   # seconds
    work_s = float(rng.uniform(0.05, 3.0))
    planner = pipelined_overlap(group_work(lengths, finish, group, work_s), [float(f.max()) for f in finish],
                                work_s, share)
    total = sum(int(ls.sum()) for ls in lengths)
    work = [[work_s * int(ls[g:g + group].sum()) / total for g in range(0, len(ls), group)] for ls in lengths]
    reference = event_overlap(finish, work, group, share)
    assert 0.0 < reference < work_s
    assert planner == pytest.approx(reference, rel=1e-9)


@dataclass(frozen=True)
class Given(LengthModel):
    """The same response lengths at every step."""
    given: tuple[int, ...] = ()

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.array(self.given, dtype=np.int64)


def finished_at(lengths: np.ndarray, trace: list[tuple[float, float, int, str]]) -> np.ndarray:
    """When each row finished, from a replica's trace: a stretch that ends with fewer rows
    running after it ended the shortest rows still running."""
    order = np.argsort(lengths, kind="stable")
    stretches = trace[1:]
    running = [rows for _, _, rows, _ in stretches] + [0]
    out, i = np.zeros(len(lengths)), 0
    for k, (start, seconds, rows, _) in enumerate(stretches):
        for _ in range(rows - running[k + 1]):
            out[order[i]] = start + seconds
            i += 1
    assert i == len(lengths)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("group", [1, 4])
def test_a_simulated_step_overlaps_what_the_event_simulation_says(seed, group):
    """With the drafter the same in both (no drafter training), the pipelined step's
    rollout is the plain one's, its overlap the event simulation's (work by tokens,
    prompts included), and the step is shorter by exactly that overlap."""
    given = LengthModel(median=1000, sigma=1.0, max_len=8192).draw(64, np.random.default_rng(seed))
    cfg = sim(steps=2, group_size=group, drafter_training=False, lengths=Given(given=tuple(int(n) for n in given)))
    plain, piped = simulate(COSTS, FIXED, cfg), simulate(COSTS, FIXED, replace(cfg, pipelined_update=True))
    per = cfg.sequences // cfg.replicas
    tokens = given + cfg.prompt_len
    work_s = FIXED.logprob_s + FIXED.update_s
    for a, b in zip(plain, piped):
        assert b.rollout_s == a.rollout_s
        shares = [given[r * per:(r + 1) * per] for r in range(cfg.replicas)]
        finish = [finished_at(ls, trace) for ls, trace in zip(shares, b.traces)]
        work = [[work_s * float(tokens[r * per + g:r * per + g + group].sum() / tokens.sum())
                 for g in range(0, per, group)] for r in range(cfg.replicas)]
        reference = event_overlap(finish, work, group)
        assert 0.0 < reference < work_s
        assert b.overlap_s == pytest.approx(reference, rel=1e-9)
        assert b.step_s == pytest.approx(a.step_s - reference, rel=1e-9)


def test_equal_when_nothing_overlaps():
    same_length = LengthModel(median=1000, sigma=0.0, max_len=8192)   # every replica ends at once
    for cfg in (sim(replicas=1, sequences=8), sim(group_size=4, lengths=same_length)):
        plain, piped = simulate(COSTS, FIXED, cfg), simulate(COSTS, FIXED, replace(cfg, pipelined_update=True))
        assert [s.step_s for s in piped] == [s.step_s for s in plain]
        assert all(s.overlap_s == 0.0 for s in piped)


def test_the_chosen_share_is_the_fastest_and_here_not_the_trivial_0():
    """Drafter training on: the idle time the update takes is the drafter's loss. On this
    workload the best share is 0.75, strictly between 0 and 1: all the idle time (1) starves the drafter,
    none (0: the unpipelined step, never slower, the trivial answer) forgoes the overlap.
    The chosen share must beat every other candidate and the plain step, so choosing 0,
    the largest share or the slowest fails."""
    cfg = sim(steps=4, group_size=4)

    def mean_step(share: float | None) -> float:
        run = cfg if share is None else replace(cfg, pipelined_update=True, update_share=share)
        return float(np.mean([s.step_s for s in simulate(COSTS, FIXED, run)]))

    plain = mean_step(None)
    assert mean_step(0.0) == plain
    chosen = recommend_share(COSTS, FIXED, cfg)
    assert 0.0 < chosen < 1.0
    assert mean_step(chosen) < min(mean_step(s) for s in SHARES if s != chosen)
    assert mean_step(chosen) < plain


def test_plan_reports_both_and_the_chosen_share_is_faster(monkeypatch):
    """On the 70B plan at rollout TP 8 (8 replicas; a layout the RL loop does not run yet, so
    without its training config), giving the update all idle capacity starves drafter training
    and is slower than not pipelining; the chosen share (neither 0 nor all) is faster."""
    from pathlib import Path

    from nemo_tlt.plan.build import make_plan
    from nemo_tlt.plan.config import load_plan_config

    conf = Path(__file__).resolve().parents[2] / "conf"
    monkeypatch.chdir(conf.parent)
    load = lambda *kv: load_plan_config(conf / "llama3.3-70b_plan.yaml", ["steps=3", "train_config=null",
                                                                    "rollout.tensor_parallel=8", *kv])  # noqa: E731
    chosen = make_plan(load("sd.pipelined_update=true"), simulate_steps=True)[0]["simulation"]
    greedy = make_plan(load("sd.pipelined_update=true", "sd.pipelined_share=1.0"), simulate_steps=True)[0]["simulation"]
    off = make_plan(load(), simulate_steps=True)[0]["simulation"]
    assert greedy["pipelined_update"]["speedup_with"] < greedy["pipelined_update"]["speedup_without"]
    assert 0.0 < chosen["pipelined_update"]["update_share"] < 1.0
    assert chosen["pipelined_update"]["speedup_with"] > chosen["pipelined_update"]["speedup_without"]
    assert chosen["speedup"] == chosen["pipelined_update"]["speedup_with"]          # modelled: the headline
    assert off["speedup"] == off["pipelined_update"]["speedup_without"] == chosen["pipelined_update"]["speedup_without"]
