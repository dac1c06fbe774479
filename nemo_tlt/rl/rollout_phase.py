"""The rollout of one RL step on one rank: its replica's whole groups, decoded by the engine.

Contract: ``rollout_phase(...)`` builds the requests of this rank's rollout replica (prompt p
with p % replicas == q, G samples each, sequence ids ``p * G + g``), samples them with the
step's seed (a function of (seed, step)), speculating as ``sd_policy`` decides (None: plain),
hands each finished row to ``on_finish`` (the pipelined update's collector, bound to the
requests first) and, when ``drafter`` harvests from the rollout, its features to the drafter's
buffer in request order (``InOrderHarvest``; a tensor-parallel replica's members each keep their
share of the rows, ``RolloutReplicas.harvests``), and returns the ``Rollout`` with its decode
segments on ``clock``.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

from nemo_tlt.rl.reporting.decode_segments import decode_segments
from nemo_tlt.rl.harvest_rows import InOrderHarvest
from nemo_tlt.rl.reporting.records import Rollout
from nemo_tlt.rl.rollout_replicas import RolloutReplicas
from nemo_tlt.rl.run import step_seed
from nemo_tlt.rollout.protocol import Request, RequestResult
from nemo_tlt.speculative.sampling import SamplingParams


def rollout_phase(engine: Any, task: Any, cfg: Any, replicas: RolloutReplicas, step: int, prompts: list, *,
                  sd_policy: Any = None, drafter: Any = None, on_finish: Any = None,
                  clock: Callable[[], float] = time.perf_counter) -> Rollout:
    """``drafter``: the ``IdleDrafter`` whose buffer takes the rollout's features (None: none)."""
    G = cfg.grpo.group_size
    ids = [p * G + g for p in replicas.prompts(len(prompts)) for g in range(G)]
    requests = [Request(task.tokenizer.encode(prompts[i // G].text, add_bos=True), seq_id=i) for i in ids]
    sampling = SamplingParams(cfg.grpo.acceptance, temperature=cfg.grpo.temperature,
                              max_new_tokens=cfg.grpo.max_new_tokens, seed=step_seed(cfg.seed, step))
    t0, t_gen = time.perf_counter(), clock()
    if on_finish is not None:
        on_finish.bind(requests, ids)
    harvest = None
    if drafter is not None:
        drafter.buffer.advance_step(step)
        harvest = InOrderHarvest(requests, partial(drafter.sample, step), drafter.buffer.add_sample,
                                 keep=replicas.harvests)
        on_finish = then(on_finish, harvest.take)
    out = engine.generate(requests, sampling, policy=sd_policy, return_hidden=harvest is not None,
                          on_finish=on_finish)
    seconds = time.perf_counter() - t0
    if harvest is not None:
        harvest.finish(out.results)
    segments = decode_segments(out.stats.trace, out.stats.prefill_s, out.stats.wall_s, t_gen)
    return Rollout(ids, requests, out, segments, seconds)


def then(first: Callable | None, second: Callable) -> Callable:
    """An ``on_finish`` sink calling ``first`` (when given), then ``second``."""
    if first is None:
        return second

    def both(index: int, result: RequestResult) -> None:
        first(index, result)
        second(index, result)
    return both
