"""Acceptance improves, measured: after the policy changes, a drafter the spot trainer
retrains on harvested rollouts of the new policy accepts more tokens per verify step
than the stale drafter (real EAGLE drafter, real torch engine, tiny target)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from nemo_tlt.spot.losses import eagle_loss_fn
from nemo_tlt.spot.trainer import SpotTrainer, DrafterOptimConfig, SpotTrainerConfig
from tiny import tiny_target

pytestmark = pytest.mark.timeout(120)
TRAIN = SpotTrainerConfig(batch_size=8, max_steps_per_round=60,
                          optim=DrafterOptimConfig(lr=5e-3, warmup_steps=5, decay_steps=115))


def _requests(n: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 8, (n,), generator=g).tolist()
    return [Request(torch.randint(3, 32, (m,), generator=g).tolist(), seq_id=i) for i, m in enumerate(lengths)]


def _harvest(target: DecoderLM, seed: int) -> HarvestBuffer:
    """Rollouts of `target` with hidden states, as the RL loop harvests them."""
    buf = HarvestBuffer(HarvestConfig(hidden_size=target.config.hidden_size))
    reqs = _requests(24, seed)
    sp = SamplingParams(mode="rejection", temperature=1.0, max_new_tokens=32, seed=seed, stop_on_eos=False)
    out = TorchRolloutEngine(target).generate(reqs, sp, return_hidden=True)
    for req, res in zip(reqs, out.results):
        buf.add(torch.tensor(list(req.prompt) + res.tokens), res.hidden_states, step=0)
    return buf


def _mean_accept(target: DecoderLM, drafter: EagleDrafter) -> float:
    sp = SamplingParams(mode="greedy", max_new_tokens=24, seed=0, stop_on_eos=False)
    engine = TorchRolloutEngine(target, drafter)
    return engine.generate(_requests(8, 99), sp, policy=FixedSDPolicy(TreeShape(3, 2, 6))).stats.mean_accept_len


def _idle_coordinator() -> WorkerCoordinator:
    store = dist.HashStore()
    coord = WorkerCoordinator(store, 0, 2, min_idle_workers=1)
    WorkerCoordinator(store, 1, 2, min_idle_workers=1)  # still busy: nobody preempts
    coord.mark_idle()
    coord.start_training()
    return coord


def _shifted(target: DecoderLM, scale: float, seed: int) -> DecoderLM:
    """The policy after RL updates: every matrix moved by `scale` of its own spread."""
    shifted = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in shifted.parameters():
            if p.dim() == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return shifted.eval()


def test_spot_retraining_on_the_new_policy_raises_acceptance():
    old_policy = tiny_target(seed=0)
    drafter = EagleDrafter(EagleConfig.from_target(old_policy.config))
    SpotTrainer(drafter, eagle_loss_fn(old_policy), TRAIN).run(_idle_coordinator(), _harvest(old_policy, seed=1))
    new_policy = _shifted(old_policy, scale=1.0, seed=5)
    stale = _mean_accept(new_policy, drafter)
    stats = SpotTrainer(drafter, eagle_loss_fn(new_policy), TRAIN).run(_idle_coordinator(),
                                                                        _harvest(new_policy, seed=2))
    fresh = _mean_accept(new_policy, drafter)
    assert stats.optimizer_steps == TRAIN.max_steps_per_round
    assert fresh > stale + 0.2, f"mean accepted length: stale {stale:.3f}, retrained {fresh:.3f}"
