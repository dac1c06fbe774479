"""Discrete-event simulation of RL steps on a planned cluster, with and without TLT.

Contract
--------
* Each RL step draws every response length from ``LengthModel`` (one numpy Generator
  seeded by ``SimConfig.seed``; TLT and the baseline see the same lengths), splits the
  sequences evenly over the rollout replicas, and simulates each replica event by
  event: all its rows start together, so between two completions the running batch is
  constant and the step cost (``RolloutCosts``) is evaluated at the mean context of
  that stretch. Plain decoding advances every row one token per step; with SD on (the
  running batch <= ``threshold``) every row advances by the arm's accepted length.
* The bandit is modelled as choosing, per stretch, the arm of highest modelled
  throughput (accepted length / step cost), except with probability ``epsilon`` a
  uniformly random arm (exploration costs what it costs).
* Drafter quality ``q`` in [0, 1] scales the accepted length: 1 + q (fresh - 1). Each
  policy update multiplies q by (1 - ``drift``); drafter training on the idle
  GPU-seconds of a step restores a fraction 1 - exp(-trained / ``recover_gpu_s``) of
  what is missing. Without drafter training q only decays.
* After the rollout: log-probs, update (``training_seconds``), weight sync (the reshard
  plan's seconds) and the host offload of the trainer's state, the same for both.
* With ``sd`` and ``drafter_training`` both off the TLT path is the baseline path: the
  two results are equal to the last bit.
* ``pipelined_update`` (the RL loop's ``policy.pipelined_update``, modelled): the log-prob
  and update work of a prompt group (``group_size`` consecutive sequences of a replica) can
  run once its last row has finished, on the replicas whose rollout is done; that work is charged
  at its share of the step's tokens of ``logprob_s + update_s``, and the idle replicas
  process it at the rate of their share of the cluster (a replica is ``1 / replicas`` of
  the GPUs the training phases are spread over). Whatever is not done when the slowest
  replica finishes runs after the rollout as before, then the optimizer step, weight sync
  and offload (the optimizer step is inside ``update_s``' tail and never overlaps). The
  idle GPU-seconds the update used are taken from drafter training, so the update gets at
  most ``update_share`` of the idle replicas' capacity and drafter training the rest
  (``recommend_share`` picks the share of the shortest mean step, 0 among the candidates,
  so the pipelined step is never predicted slower). With no replica idle before the
  rollout ends the step equals the unpipelined one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.plan.costs import RolloutCosts
from nemo_tlt.speculative.tree_shape import TreeShape


@dataclass(frozen=True)
class LengthModel:
    """Response lengths: lognormal with ``median`` and ``sigma`` (tail heaviness), clipped to
    [1, max_len]; or, when ``samples`` is given, drawn from those measured lengths."""

    median: float = 2000.0
    sigma: float = 1.0
    max_len: int = 16384
    samples: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_float("lengths.median", self.median, 1.0)
        check_float("lengths.sigma", self.sigma, 0.0)
        check_int("lengths.max_len", self.max_len, 1)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.samples:
            return rng.choice(np.asarray(self.samples, dtype=np.int64), size=n)
        raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)


def paged_kv_peak_tokens(model: LengthModel, rows: int, prompt_len: int, rng: np.random.Generator,
                         draws: int = 64) -> int:
    """Peak cached tokens of a replica whose ``rows`` sequences start together and free their
    pages when they finish: max over k of k x (prompt + k-th longest), the worst of ``draws``."""
    worst = 0
    for _ in range(draws):
        desc = np.sort(model.draw(rows, rng))[::-1]
        worst = max(worst, int(np.max(np.arange(1, rows + 1) * (prompt_len + desc))))
    return worst


@dataclass(frozen=True)
class SimConfig:
    steps: int = 8
    seed: int = 0
    sequences: int = 512          # prompts x group size per RL step
    replicas: int = 8             # rollout replicas (GPUs / rollout TP)
    prompt_len: int = 512
    sd: bool = True
    drafter_training: bool = True
    threshold: int = 32           # SD on at <= this many running rows per replica
    arms: tuple[tuple[TreeShape, float], ...] = ()  # (shape, accepted length with a fresh drafter)
    epsilon: float = 0.1
    drift: float = 0.3
    recover_gpu_s: float = 60.0
    initial_quality: float = 1.0
    lengths: LengthModel = field(default_factory=LengthModel)
    group_size: int = 1           # sequences per prompt group (pipelined update: a group's unit of work)
    pipelined_update: bool = False
    update_share: float = 1.0     # of the idle replicas' capacity, what the pipelined update may take

    def __post_init__(self) -> None:
        check_int("sim.steps", self.steps, 1)
        check_int("sim.group_size", self.group_size, 1)
        check_float("sim.update_share", self.update_share, 0.0, 1.0)
        check_int("sim.sequences", self.sequences, 1)
        check_int("sim.replicas", self.replicas, 1)
        check_int("sim.threshold", self.threshold, 0)
        check_float("sim.epsilon", self.epsilon, 0.0, 1.0)
        check_float("sim.drift", self.drift, 0.0, 1.0)
        check_float("sim.recover_gpu_s", self.recover_gpu_s, 0.0, lo_open=True)
        check_float("sim.initial_quality", self.initial_quality, 0.0, 1.0)
        if self.sequences % self.replicas:
            raise ValueError(f"sim.sequences={self.sequences} must split evenly over sim.replicas={self.replicas}")
        if self.sd and not self.arms:
            raise ValueError("sim.arms must list at least one (tree shape, accepted length) when SD is on")
        for shape, acc in self.arms:
            if not 1.0 <= acc <= shape.depth + 1:
                raise ValueError(f"sim.arms: accepted length {acc} of {shape} must be in [1, depth + 1]")

    def baseline(self) -> "SimConfig":
        """The plain synchronous step: no SD, no drafter training, no pipelined update."""
        return replace(self, sd=False, drafter_training=False, pipelined_update=False)


@dataclass(frozen=True)
class FixedCosts:
    """Per-step seconds outside the rollout (identical with and without TLT)."""
    logprob_s: float
    update_s: float
    weight_sync_s: float
    offload_s: float = 0.0


def _arm_throughput(costs: RolloutCosts, rows: int, ctx: float, shape: TreeShape, acc: float) -> float:
    return acc / costs.sd_step(rows, ctx, shape)


def simulate_replica(lengths: np.ndarray, prompt_len: int, costs: RolloutCosts, cfg: SimConfig, quality: float,
                     rng: np.random.Generator) -> tuple[float, list[tuple[float, float, int, str]]]:
    """(seconds, trace of (start, seconds, running rows, arm or '')) of one replica's rollout."""
    order = np.sort(lengths)
    t = costs.prefill(len(order), prompt_len)
    trace = [(0.0, t, len(order), "prefill")]
    done = 0  # tokens every running row has generated
    for i, target in enumerate(order):
        if target <= done:
            continue
        rows = len(order) - i
        ctx = rows * (prompt_len + (done + target) / 2)
        tokens = float(target - done)
        if cfg.sd and rows <= cfg.threshold:
            arms = [(s, 1.0 + quality * (a - 1.0)) for s, a in cfg.arms]
            if rng.random() < cfg.epsilon:
                shape, acc = arms[int(rng.integers(len(arms)))]
            else:
                shape, acc = max(arms, key=lambda sa: _arm_throughput(costs, rows, ctx, *sa))
            seconds = tokens / acc * costs.sd_step(rows, ctx, shape)
            label = str(shape)
        else:
            seconds = tokens * costs.decode_step(rows, ctx)
            label = ""
        trace.append((t, seconds, rows, label))
        t += seconds
        done = int(target)
    return t, trace


def finish_times(lengths: np.ndarray, trace: list[tuple[float, float, int, str]]) -> np.ndarray:
    """When each row of ``simulate_replica``'s rollout finished (in the order of ``lengths``):
    its trace holds, after the prefill, one stretch per distinct length > 0 in increasing
    order, ending when the rows of that length finish; a row of length 0 ends with the prefill."""
    lengths = np.asarray(lengths)
    prefill_end = trace[0][0] + trace[0][1]
    ends = {int(n): start + seconds for n, (start, seconds, _, _) in zip(np.unique(lengths[lengths > 0]), trace[1:])}
    return np.array([ends[int(n)] if n > 0 else prefill_end for n in lengths])


def pipelined_overlap(group_done: list[tuple[float, float]], replica_end: list[float], work_s: float,
                      share: float = 1.0) -> float:
    """Seconds of the cluster's log-prob + update work done before the rollout ends.

    ``group_done``: (time the group's last row finished, its share of ``work_s``) for every
    group; ``replica_end``: when each replica's rollout finished. Between two events the
    idle replicas' share of the cluster c and the work of finished groups A are constant,
    and the work done P grows as min(A, P + share x c x dt)."""
    rollout = max(replica_end)
    n = len(replica_end)
    events = sorted({t for t, _ in group_done} | set(replica_end))
    done = 0.0
    for t0, t1 in zip(events, events[1:] + [rollout]):
        if t0 >= rollout:
            break
        capacity = share * sum(e <= t0 for e in replica_end) / n
        available = sum(w for t, w in group_done if t <= t0)
        done = min(available, done + capacity * (min(t1, rollout) - t0))
    return min(done, work_s)


@dataclass
class StepResult:
    rollout_s: float
    step_s: float
    idle_gpu_s: float
    trained_gpu_s: float
    quality: float
    replica_s: list[float]
    traces: list[list[tuple[float, float, int, str]]]
    overlap_s: float = 0.0   # log-prob + update seconds done during the rollout (pipelined update)


def simulate(costs: RolloutCosts, fixed: FixedCosts, cfg: SimConfig) -> list[StepResult]:
    """Every RL step of one configuration (TLT or baseline), deterministic for ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    quality, out = cfg.initial_quality, []
    per_replica = cfg.sequences // cfg.replicas
    gpus = costs.tp
    for _ in range(cfg.steps):
        lengths = cfg.lengths.draw(cfg.sequences, rng)
        arm_rng = np.random.default_rng(rng.integers(2 ** 63))
        shares = [lengths[r * per_replica:(r + 1) * per_replica] for r in range(cfg.replicas)]
        runs = [simulate_replica(share, cfg.prompt_len, costs, cfg, quality, arm_rng) for share in shares]
        ends = [s for s, _ in runs]
        rollout = max(ends)
        idle = sum(rollout - e for e in ends) * gpus
        work = fixed.logprob_s + fixed.update_s
        overlap = _overlap(shares, runs, ends, work, cfg) if cfg.pipelined_update else 0.0
        trained = max(0.0, idle - overlap * gpus * cfg.replicas) if cfg.drafter_training else 0.0
        step = rollout + work - overlap + fixed.weight_sync_s + fixed.offload_s
        out.append(StepResult(rollout, step, idle, trained, quality, ends, [tr for _, tr in runs], overlap))
        quality *= 1.0 - cfg.drift
        quality += (1.0 - quality) * (1.0 - math.exp(-trained / cfg.recover_gpu_s))
    return out


def _overlap(shares: list[np.ndarray], runs: list, ends: list[float], work_s: float, cfg: SimConfig) -> float:
    done = [finish_times(share, trace) for share, (_, trace) in zip(shares, runs)]
    groups = group_work(shares, done, cfg.group_size, work_s, cfg.prompt_len)
    return pipelined_overlap(groups, ends, work_s, cfg.update_share)


def group_work(lengths: list[np.ndarray], done: list[np.ndarray], group_size: int, work_s: float,
               prompt_len: int = 0) -> list[tuple[float, float]]:
    """(when the group's last row finished, its share of ``work_s`` by its tokens, prompts
    included) for every ``group_size`` consecutive rows of every replica: the
    ``group_done`` of :func:`pipelined_overlap`. ``done``: each replica's row finish times."""
    tokens = sum(float(np.sum(ls)) + prompt_len * len(ls) for ls in lengths)
    out = []
    for ls, ends in zip(lengths, done):
        for g in range(0, len(ls), group_size):
            rows = slice(g, g + group_size)
            share = (float(np.sum(ls[rows])) + prompt_len * len(ls[rows])) / tokens if tokens > 0 else 0.0
            out.append((float(np.max(ends[rows])), work_s * share))
    return out


def summarize(tlt: list[StepResult], base: list[StepResult]) -> dict[str, float]:
    """The ``simulation`` block of the plan JSON (means over steps)."""
    def mean(xs):
        return float(np.mean(xs))
    tlt_s, base_s = mean([s.step_s for s in tlt]), mean([s.step_s for s in base])
    return {"speedup": base_s / tlt_s, "tlt_step_s": tlt_s, "baseline_step_s": base_s,
            "rollout_share": mean([s.rollout_s / s.step_s for s in base]),
            "tlt_rollout_share": mean([s.rollout_s / s.step_s for s in tlt]),
            "idle_gpu_s": mean([s.idle_gpu_s for s in base]),
            "tlt_drafter_training_gpu_s": mean([s.trained_gpu_s for s in tlt]),
            "rollout_speedup": mean([s.rollout_s for s in base]) / mean([s.rollout_s for s in tlt]),
            "final_drafter_quality": tlt[-1].quality,
            "update_overlap_s": mean([s.overlap_s for s in tlt])}


SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def recommend_share(costs: RolloutCosts, fixed: FixedCosts, cfg: SimConfig) -> float:
    """The update share (``SHARES``) of the shortest mean simulated step with the pipelined
    update; 0 (no overlap: the unpipelined step) is a candidate and wins ties."""
    best = None
    for share in SHARES:
        run = simulate(costs, fixed, replace(cfg, pipelined_update=True, update_share=share))
        mean_step = float(np.mean([s.step_s for s in run]))
        if best is None or mean_step < best[0]:
            best = (mean_step, share)
    return best[1]


def recommend(costs: RolloutCosts, fixed: FixedCosts, cfg: SimConfig) -> dict:
    """The SD threshold (powers of two up to the per-replica batch) of the shortest simulated
    TLT step, and the arms the modelled bandit used at that threshold."""
    per_replica = cfg.sequences // cfg.replicas
    candidates = sorted({2 ** k for k in range(0, int(math.log2(per_replica)) + 1)} | {per_replica})
    best = None
    for threshold in candidates:
        run = simulate(costs, fixed, replace(cfg, threshold=threshold, steps=min(cfg.steps, 3)))
        mean_step = float(np.mean([s.step_s for s in run]))
        if best is None or mean_step < best[0]:
            best = (mean_step, threshold, run)
    _, threshold, run = best
    used: dict[str, float] = {}
    for step in run:
        for trace in step.traces:
            for _, seconds, _, label in trace:
                if label and label != "prefill":
                    used[label] = used.get(label, 0.0) + seconds
    total = sum(used.values()) or 1.0
    arms = [a for a, s in sorted(used.items(), key=lambda kv: -kv[1]) if s / total >= 0.05]
    return {"threshold": threshold, "arms": arms}
