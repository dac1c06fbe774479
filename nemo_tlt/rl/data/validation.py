"""Evaluation on held-out prompts during training (the ``validation:`` block).

Contract
--------
* :func:`validation_prompts` builds the validation source once (``task.source`` with
  ``validation.options`` over ``task.options``) and fixes its prompts: every row, or
  ``num_prompts`` of them drawn once from the run's seed, the same at every evaluation
  and in TLT and its baseline.
* :func:`is_due` says whether step ``step`` ends with an evaluation (after every
  ``every``-th step: ``(step + 1) % every == 0``).
* :func:`validate` is collective when given a ``comm``: every rollout replica decodes its
  share of the prompts (p % replicas == replica; without ``replicas`` each rank is one) with
  the rollout engine (every member of a replica, its engine being tensor-parallel), scores it with the task's
  reward, and rank 0 returns the record of the replica leaders' shares; the others return None. The record:
  ``{"step", "mode", "split": "validation", "mean_reward", "mean_response_len",
  "num_prompts", "validation_s"}`` plus ``accuracy`` when the reward says what a correct
  answer scores (its ``correct_at``: the share of responses whose reward is >= it).
* Decoding is plain unless an SD policy is passed (SD is lossless, so the tokens are the
  same; passing none keeps the run's SD policy from learning on validation rollouts).
  Sampling comes from :func:`validation_sampling`, a function of (config, step) only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from nemo_tlt.rl.rollout_replicas import RolloutReplicas
from nemo_tlt.rl.run import step_seed
from nemo_tlt.rl.data.task import Prompt, Task, build_source
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams

if TYPE_CHECKING:
    from nemo_tlt.config import TLTConfig, ValidationConfig
    from nemo_tlt.dist import Comm


def is_due(cfg: "ValidationConfig", step: int) -> bool:
    return cfg.every > 0 and (step + 1) % cfg.every == 0


def validation_prompts(cfg: "TLTConfig") -> list[Prompt]:
    """The fixed validation prompts of a run (see the module docstring)."""
    source = build_source(cfg.task.source, {**cfg.task.options, **cfg.validation.options})
    n = cfg.validation.num_prompts
    if n is None:
        if not hasattr(source, "__len__"):
            raise ValueError(f"validation.num_prompts: task.source={cfg.task.source!r} has no length; "
                             "say how many validation prompts to draw")
        n = len(source)
    # step 0 of a generator of its own: with order=epochs, the first n rows of the first epoch
    return source.prompts(0, n, np.random.default_rng([cfg.seed, 0x7A11D]))


def validation_sampling(cfg: "TLTConfig", step: int) -> SamplingParams:
    v, g = cfg.validation, cfg.grpo
    max_new = v.max_new_tokens or g.max_new_tokens
    if v.greedy:
        return SamplingParams("greedy", max_new_tokens=max_new, seed=step_seed(cfg.seed, step) ^ 0x7A11D)
    return SamplingParams(g.acceptance, temperature=g.temperature, max_new_tokens=max_new,
                          seed=step_seed(cfg.seed, step) ^ 0x7A11D)


@dataclass
class ValidationShard:
    """One rank's share of a validation pass: per prompt index, its reward and response length."""

    ids: list[int]
    rewards: list[float]
    lengths: list[int]


def _decode_share(engine: Any, task: Task, prompts: list[Prompt], ids: list[int], sampling: SamplingParams,
                  sd_policy: Any) -> ValidationShard:
    requests = [Request(task.tokenizer.encode(prompts[i].text, add_bos=True), seq_id=i) for i in ids]
    results = engine.generate(requests, sampling, policy=sd_policy).results if requests else []
    rewards = [task.reward(prompts[i], task.tokenizer.decode(r.tokens)) for i, r in zip(ids, results)]
    return ValidationShard(ids, rewards, [len(r.tokens) for r in results])


def validation_record(step: int, mode: str, shards: list[ValidationShard], correct_at: float | None,
                      seconds: float) -> dict[str, Any]:
    """The metrics record of one validation pass from every rank's share."""
    rewards = np.array([x for s in shards for x in s.rewards], dtype=np.float64)
    lengths = np.array([x for s in shards for x in s.lengths], dtype=np.float64)
    record: dict[str, Any] = {"step": step, "mode": mode, "split": "validation",
                              "mean_reward": float(rewards.mean()), "mean_response_len": float(lengths.mean()),
                              "num_prompts": int(rewards.size), "validation_s": seconds}
    if correct_at is not None:
        record["accuracy"] = float((rewards >= correct_at).mean())
    return record


def validate(engine: Any, task: Task, prompts: list[Prompt], sampling: SamplingParams, step: int, mode: str,
             comm: "Comm | None" = None, sd_policy: Any = None,
             replicas: "RolloutReplicas | None" = None) -> dict[str, Any] | None:
    """One validation pass at the end of step ``step`` (see the module docstring)."""
    if not prompts:
        raise ValueError("validate: no validation prompts")
    t0 = time.perf_counter()
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    replicas = replicas or RolloutReplicas(rank, world)
    mine = _decode_share(engine, task, prompts, replicas.prompts(len(prompts)), sampling, sd_policy)
    shards = comm.gather(mine) if comm is not None else [mine]
    if rank != 0:
        return None
    shards = shards[::replicas.tp]  # each replica's leader
    return validation_record(step, mode, shards, task.reward.correct_at, time.perf_counter() - t0)
