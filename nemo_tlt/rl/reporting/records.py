"""Typed per-rank results of one RL step, and the step record rank 0 logs.

``RankStep`` is what every rank contributes at the end of a step (one all-gather; rank 0 uses it);
``step_record`` folds the ranks' results into the JSON record of metrics.jsonl
(the keys ``nemo_tlt.rl.reporting.report`` plots and compares). Pure functions, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_tlt.rl.reporting.logprob_gap import gap_metrics
from nemo_tlt.rl.run import digest
from nemo_tlt.rollout.protocol import GenerateOutput, Request, StepTrace

UPDATE_SUMS = ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")
PHASES = ("rollout_s", "logprob_s", "update_s", "weight_sync_s")


@dataclass
class Rollout:
    """One rank's rollout of one step."""

    ids: list[int]             # sequence ids p * G + g
    requests: list[Request]
    out: GenerateOutput
    segments: list[tuple[float, float, str]]  # (start, end, "plain" | tree) on the coordinator's clock
    seconds: float


@dataclass
class IdleResult:
    """One rank's idle window of one step."""

    idle_s: float = 0.0
    train_s: float = 0.0
    drafter_samples: int = 0
    drafter_steps: int = 0
    drafter_loss: float | None = None
    stop_latency_s: float | None = None  # preemption requested -> trainer stopped
    drafter_sync_s: float = 0.0
    sync_hierarchical: bool = False  # the drafter average went through the node leaders


@dataclass
class RankState:
    """What a rank must get back to resume exactly (JSON-serialisable)."""

    sd_policy: dict[str, Any] | None = None
    generator: list[int] | None = None  # the drafter trainer's sampling generator


@dataclass
class RankStep:
    rank: int
    node: int                      # the host it runs on (per-node idle / training time)
    ids: list[int]                 # sequence ids of this rank's rollout (p * G + g)
    tokens: list[list[int]]
    rewards: list[float]
    gen_s: float
    sd_steps: int
    plain_steps: int
    accept_lengths: list[int]
    segments: list[tuple[float, float, str]]  # (start, end, "plain" | tree) on the coordinator's clock
    idle: IdleResult
    update: dict[str, float]
    state: RankState
    weights: str | None            # digest of this rank's synced policy + drafter weights (None: not hashed)
    # per tree shape: [tokens emitted, row-steps] of its SD steps (``arm_accept_counts``)
    arm_accept: dict[str, list[int]] = field(default_factory=dict)
    update_work_s: float = 0.0     # seconds this rank spent on the policy update (log-probs, gradients, step)
    policy_digest: str | None = None  # digest of the synced policy weights alone (TLT and baseline must agree)
    prompt_tokens: int = 0         # prompt tokens of this rank's rollout (a replica's leader only)


def arm_accept_counts(trace: list[StepTrace]) -> dict[str, list[int]]:
    """Per tree shape, [tokens emitted, rows stepped] over the rollout's SD steps: their
    ratio is that shape's accepted length (tokens per row per verify step), token-weighted."""
    out: dict[str, list[int]] = {}
    for s in trace:
        if s.shape is not None:
            acc = out.setdefault(s.shape, [0, 0])
            acc[0] += int(s.tokens)
            acc[1] += int(s.running)
    return dict(sorted(out.items()))


def step_record(step: int, mode: str, num_seqs: int, ranks: list[RankStep], times: dict[str, float],
                timeline: list, t0: float, now: float) -> dict[str, Any]:
    """The step's JSON record from every rank's result (``times``: phase seconds of rank 0;
    ``timeline``: the coordinator's events; times on the coordinator's clock, shared by
    all ranks, are logged relative to the run's start ``t0``)."""
    rewards, tokens = [0.0] * num_seqs, [[] for _ in range(num_seqs)]
    for r in ranks:
        for i, rew, toks in zip(r.ids, r.rewards, r.tokens):
            rewards[i], tokens[i] = rew, toks
    lengths = [len(t) for t in tokens]
    accept = [a for r in ranks for a in r.accept_lengths]
    other = times["step_s"] - sum(times[k] for k in PHASES)
    return {
        "step": step, "mode": mode,
        "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
        "accuracy": float(np.mean([r == 1.0 for r in rewards])),
        "resp_len_mean": float(np.mean(lengths)), "resp_len_median": float(np.median(lengths)),
        "resp_len_max": int(max(lengths)), "tokens": int(sum(lengths)),
        "prompt_tokens": int(sum(r.prompt_tokens for r in ranks)),
        "resp_lens": lengths,  # per sequence (id order): the length distribution `nemo-tlt plan --measured` reads
        **times, "other_s": other,
        "rollout_gen_s": [r.gen_s for r in ranks],
        **_idle_fields(ranks),
        "sd_steps": int(sum(r.sd_steps for r in ranks)),
        "plain_steps": int(sum(r.plain_steps for r in ranks)),
        "mean_accept_len": float(np.mean(accept)) if accept else 0.0,
        # per tree shape, [tokens, row-steps] of its SD steps, summed over ranks (accepted length = ratio)
        "accept_by_arm": _sum_arms(ranks),
        **{k: sum(r.update[k] for r in ranks) for k in UPDATE_SUMS},
        "grad_norm": ranks[0].update["grad_norm"],
        # the response tokens the algorithm counted in the loss's token mean (every rank's figure)
        "loss_tokens": int(ranks[0].update["loss_tokens"]),
        # generation vs policy log-probs of the step's tokens (nemo_tlt.rl.reporting.logprob_gap); None without them
        **gap_metrics([r.update for r in ranks]),
        # data parallelism must keep every rank's policy and drafter bit-identical
        # None at a step whose weights were not hashed (debug.weight_digests)
        "replicas_identical": (None if ranks[0].weights is None
                               else all(r.weights == ranks[0].weights for r in ranks)),
        "policy_digest": ranks[0].policy_digest,
        # the update's work, wherever it ran (worker-seconds / workers): the same in TLT and baseline
        "update_work_s": float(np.mean([r.update_work_s for r in ranks])),
        "rewards": rewards, "rollout_digest": digest(tokens),
        "timeline": [[e.rank, e.state.value, e.time - t0] for e in timeline],
        # per rank, where its rollout decoded plainly or with which tree (run-length)
        "decode_segments": [[r.rank, round(a - t0, 4), round(b - t0, 4), choice]
                            for r in ranks for a, b, choice in r.segments],
        "t_end": now - t0,
        "run_started": t0,  # this process's run start: a resumed run's records differ here
    }


def _idle_fields(ranks: list[RankStep]) -> dict[str, Any]:
    """The idle time and the drafter's training of every rank, totals and per node."""
    losses = [r.idle.drafter_loss for r in ranks if r.idle.drafter_loss is not None]
    latencies = [r.idle.stop_latency_s for r in ranks if r.idle.stop_latency_s is not None]
    return {
        "drafter_train_s": float(sum(r.idle.train_s for r in ranks)),
        "idle_s": float(sum(r.idle.idle_s for r in ranks)),
        # worker-seconds per node (keys: node ids), where the cluster's gaps were
        "idle_s_per_node": _per_node(ranks, lambda r: r.idle.idle_s),
        "drafter_train_s_per_node": _per_node(ranks, lambda r: r.idle.train_s),
        "drafter_samples_per_node": {k: int(v) for k, v in _per_node(ranks, lambda r: r.idle.drafter_samples).items()},
        "drafter_sync_hierarchical": any(r.idle.sync_hierarchical for r in ranks),
        "rank_nodes": [r.node for r in sorted(ranks, key=lambda r: r.rank)],  # node of rank 0, 1, ...
        "drafter_sync_s": float(max(r.idle.drafter_sync_s for r in ranks)),
        "drafter_samples": int(sum(r.idle.drafter_samples for r in ranks)),
        "drafter_steps": int(sum(r.idle.drafter_steps for r in ranks)),
        "drafter_loss": float(np.mean(losses)) if losses else None,
        "preempt_latency_ms": 1000 * max(latencies) if latencies else None,
    }


def _per_node(ranks: list[RankStep], value) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in ranks:
        out[str(r.node)] = out.get(str(r.node), 0.0) + float(value(r))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _sum_arms(ranks: list[RankStep]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in ranks:
        for arm, (tokens, rows) in r.arm_accept.items():
            acc = out.setdefault(arm, [0, 0])
            acc[0] += tokens
            acc[1] += rows
    return dict(sorted(out.items()))
