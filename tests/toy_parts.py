"""Parts defined outside the package and named by import path from a config only (no edit of
nemo_tlt): a rollout engine, an RL algorithm, a drafter kind and a cluster launcher;
tests/rl/test_extension_points.py runs the demo loop with them."""
from __future__ import annotations

import os
from types import SimpleNamespace

from nemo_tlt.dist.launchers import ClusterLauncher
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.kinds import EAGLE, DrafterKind
from nemo_tlt.model.config import LMConfig
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine


class CountingEngine(TorchRolloutEngine):
    """The embedded engine, writing one line per ``generate`` to ``$TOY_ENGINE_LOG``."""

    def generate(self, requests, sampling, **kwargs):
        with open(os.environ["TOY_ENGINE_LOG"], "a") as log:
            log.write(f"{os.getpid()} {len(requests)}\n")
        return super().generate(requests, sampling, **kwargs)


def counting_engine(config, model_dir, placement, *, tp=None, drafter=None, max_batch=None, policy=None):
    """A rollout-engine factory (``rollout.engine: toy_parts:counting_engine``)."""
    return CountingEngine.from_hf_folder(model_dir, device=placement.device, dtype=placement.dtype, tp=tp,
                                         compute_dtype=config.engine_compute_dtype)


class FirstHalfGRPO:
    """An RL algorithm (``algorithm: toy_parts:FirstHalfGRPO``): GRPO's advantages + 1 for the
    first half of each group, which alone counts. Its loss checks that no dropped row (advantage
    exactly 0) reaches it with a token, and writes one line per call to ``$TOY_ALGORITHM_LOG``:
    ``pid, rows dropped, counted tokens``."""

    def advantages(self, outcomes):
        import torch

        from nemo_tlt.algorithms.grpo import group_advantages
        from nemo_tlt.algorithms.protocol import Advantages

        G = outcomes.group_size
        first_half = (torch.arange(G) < G // 2).expand_as(outcomes.truncated)
        return Advantages.of(group_advantages(outcomes.rewards, G) + 1.0, first_half, outcomes)

    def policy_loss(self, logp_new, logp_old, advantages, mask, clip_eps):
        from nemo_tlt.algorithms.loss import clipped_pg_loss

        dropped = advantages.reshape(-1) == 0
        if mask[dropped].sum() != 0:
            raise AssertionError("FirstHalfGRPO: a dropped row reached the loss with tokens")
        with open(os.environ["TOY_ALGORITHM_LOG"], "a") as log:
            log.write(f"{os.getpid()} {int(dropped.sum())} {int(mask.sum())}\n")
        return clipped_pg_loss(logp_new, logp_old, advantages, mask, clip_eps)



def _log(line: str) -> None:
    with open(os.environ["TOY_DRAFTER_LOG"], "a") as log:
        log.write(f"{os.getpid()} {line}\n")


class CountingEagle(EagleDrafter):
    """The EAGLE drafter as a drafter kind of its own, named by import path (its
    ``drafter.json``: ``"kind": "toy_parts:COUNTING_EAGLE"``), writing a line to
    ``$TOY_DRAFTER_LOG`` per draft and per training loss."""

    kind = "toy_parts:COUNTING_EAGLE"

    def propose(self, state, ctx, shape):
        _log("propose")
        return super().propose(state, ctx, shape)


def _counting_loss(drafter, target, batch, feat, reg_weight, ce_weight):
    _log("loss")
    return EAGLE.loss(drafter, target, batch, feat, reg_weight, ce_weight)


COUNTING_EAGLE = DrafterKind("toy_parts:COUNTING_EAGLE",
                             lambda config: CountingEagle(EagleConfig(LMConfig(**config["layer"]))),
                             EAGLE.config_dict, _counting_loss)


def _local_as_cluster(fn, world_size, *args, collective_timeout_s=300.0, threads=1, device="cpu"):
    """Start the ranks as local processes, log the launch to ``$TOY_LAUNCHER_LOG``; rank 0's value."""
    from nemo_tlt.dist import launch_local

    with open(os.environ["TOY_LAUNCHER_LOG"], "a") as log:
        log.write(f"{os.getpid()} {world_size}\n")
    return launch_local(fn, world_size, *args, timeout_s=None, collective_timeout_s=collective_timeout_s,
                        threads=threads, start_method="fork", device=device)[0]


# A cluster launcher (``workers.launcher: toy_parts:TOY_LAUNCHER``) whose "cluster" is this
# machine: this process stands for task 0 of 1 and starts the ranks itself.
TOY_LAUNCHER = ClusterLauncher("toy_parts:TOY_LAUNCHER", claims=lambda env: False,
                               task=lambda env: SimpleNamespace(rank=0, world=1, local_rank=0),
                               local_refusal=lambda env, num_workers: None, launch=_local_as_cluster)
