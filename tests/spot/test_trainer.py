"""Tests for nemo_tlt.spot.trainer (+ averaging, losses): schedule, training, bounded
preemption, exact resume, and the EAGLE loss adapter. Multi-process tests live in
test_spot_multiprocess.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.spot.averaging import average_replicas
from nemo_tlt.spot.checkpoint import CheckpointManager
from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from nemo_tlt.spot.losses import eagle_loss_fn
from nemo_tlt.spot.trainer import SpotTrainer, DrafterOptimConfig, SpotTrainerConfig, lr_schedule
from tiny import tiny_target

from ._toys import H, open_coordinator, regression_loss, toy_buffer, toy_model

pytestmark = pytest.mark.timeout(60)


def test_config_validation_and_schedule():
    with pytest.raises(ValueError, match="lr"):
        SpotTrainerConfig(optim=DrafterOptimConfig(lr=0.0))
    with pytest.raises(ValueError, match="grad_accum"):
        SpotTrainerConfig(grad_accum=0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        SpotTrainerConfig(optim=DrafterOptimConfig(betas=[0.9, 1.0]))
    cfg = SpotTrainerConfig(optim=DrafterOptimConfig(lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1))
    assert [lr_schedule(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_schedule(4, cfg) == pytest.approx(1.0)
    assert lr_schedule(9, cfg) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_schedule(14, cfg) == pytest.approx(0.1) and lr_schedule(100, cfg) == pytest.approx(0.1)


def test_run_trains_until_round_cap_and_counts_samples():
    buf = toy_buffer()
    cfg = SpotTrainerConfig(batch_size=4, max_steps_per_round=60,
                            optim=DrafterOptimConfig(lr=3e-2, warmup_steps=0, grad_clip=0.0))
    trainer = SpotTrainer(toy_model(), regression_loss, cfg)
    with torch.no_grad():
        first = float(regression_loss(trainer.model, buf.samples()))
    stats = trainer.run(open_coordinator(), buf)
    assert not stats.preempted and stats.optimizer_steps == 60 and stats.micro_steps == 60
    assert stats.samples == 240 and stats.tokens == 240 * 9 and trainer.samples_since_sync == 240
    with torch.no_grad():
        assert float(regression_loss(trainer.model, buf.samples())) < 0.2 * first
    assert trainer.run(open_coordinator(), HarvestBuffer(HarvestConfig(hidden_size=H))).micro_steps == 0


class _PreemptAt:
    """A loss that asks for preemption during its `at`-th call (a request landing mid-micro-step)."""

    def __init__(self, coord: WorkerCoordinator, at: int) -> None:
        self.coord, self.at, self.calls = coord, at, 0

    def __call__(self, model, samples):
        self.calls += 1
        if self.calls == self.at:
            self.coord.mark_busy()
        return regression_loss(model, samples)


def test_preemption_stops_within_one_micro_step_and_drops_partial_accumulation():
    coord = open_coordinator()
    loss = _PreemptAt(coord, at=5)
    trainer = SpotTrainer(toy_model(), loss, SpotTrainerConfig(batch_size=3, grad_accum=2))
    snapshots = []
    original_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        snapshots.append(trainer.model.weight.detach().clone())
        return out

    trainer.optimizer.step = recording_step
    stats = trainer.run(coord, toy_buffer())
    # Calls 1-4 made two full steps; call 5 (first of step 3) saw the request land,
    # so micro-step 6 never starts and the half-accumulated gradient is dropped.
    assert stats.preempted and loss.calls == 5 and stats.micro_steps == 5
    assert stats.optimizer_steps == 2 and stats.samples == 2 * 2 * 3
    assert torch.equal(trainer.model.weight, snapshots[-1])
    assert all(p.grad is None for p in trainer.model.parameters())


def test_preemption_from_another_thread_is_seen_before_the_next_micro_step():
    coord = open_coordinator()
    starts: list[float] = []

    def timed_loss(model, samples):
        starts.append(time.perf_counter())
        return regression_loss(model, samples)

    trainer = SpotTrainer(toy_model(), timed_loss, SpotTrainerConfig(batch_size=2))
    buf = toy_buffer()
    requested: list[float] = []

    def preempt_later():
        while len(starts) < 20:
            time.sleep(0.001)
        coord.mark_busy()
        requested.append(time.perf_counter())

    thread = threading.Thread(target=preempt_later)
    thread.start()
    stats = trainer.run(coord, buf)
    thread.join(timeout=10)
    assert stats.preempted
    assert sum(t > requested[0] for t in starts) <= 1  # at most the micro-step already past its check


def test_state_dict_gives_exact_resume():
    cfg = SpotTrainerConfig(batch_size=3, max_steps_per_round=3,
                            optim=DrafterOptimConfig(lr=1e-2, warmup_steps=2))
    a = SpotTrainer(toy_model(), regression_loss, cfg, rank=1)
    buf = toy_buffer()
    a.run(open_coordinator(), buf)
    b = SpotTrainer(toy_model(seed=9), regression_loss, cfg, rank=1)
    b.model.load_state_dict(a.model.state_dict())
    b.load_state_dict(a.state_dict())
    a.run(open_coordinator(), buf)
    b.run(open_coordinator(), buf)
    assert a.step == b.step == 6
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_resume_through_checkpoint_manager(tmp_path):
    cfg = SpotTrainerConfig(batch_size=3, max_steps_per_round=3,
                            optim=DrafterOptimConfig(lr=1e-2, warmup_steps=2))
    a = SpotTrainer(toy_model(), regression_loss, cfg)
    buf = toy_buffer()
    a.run(open_coordinator(), buf)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save_async(a.step, a.model.state_dict(), {"trainer": a.state_dict()}, {"bandit": {"counts": [1, 2]}})
        mgr.wait()
        ckpt = mgr.load(expected_shapes={k: v.shape for k, v in a.model.state_dict().items()})
    b = SpotTrainer(toy_model(seed=3), regression_loss, cfg)
    b.model.load_state_dict(ckpt.tensors)
    b.load_state_dict(ckpt.extra_state["trainer"])
    a.run(open_coordinator(), buf)
    b.run(open_coordinator(), buf)
    assert ckpt.step == 3 and ckpt.json_state == {"bandit": {"counts": [1, 2]}}
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_average_replicas_without_process_group_is_identity():
    model = toy_model()
    before = [p.clone() for p in model.parameters()]
    stats = average_replicas(model, None, 5)
    assert stats.world_size == 1 and stats.total_samples == 5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_eagle_loss_fn_trains_the_real_drafter_on_harvested_states():
    target = tiny_target(seed=0)
    g = torch.Generator().manual_seed(0)
    buf = HarvestBuffer(HarvestConfig(hidden_size=target.config.hidden_size))
    with torch.no_grad():
        for _ in range(12):
            ids = torch.randint(3, target.config.vocab_size, (1, 14), generator=g)
            hidden = target.hidden(ids)[0]  # [L, H]: the last row predicts beyond the sample
            buf.add(ids[0], hidden, step=0)
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    loss_fn = eagle_loss_fn(target)
    with torch.no_grad():
        first, _ = loss_fn(drafter, buf.samples())
    trainer = SpotTrainer(drafter, loss_fn, SpotTrainerConfig(batch_size=6, optim=DrafterOptimConfig(lr=5e-3, warmup_steps=2),
                                                              max_steps_per_round=40))
    stats = trainer.run(open_coordinator(), buf)
    with torch.no_grad():
        last, extra = loss_fn(drafter, buf.samples())
    assert stats.optimizer_steps == 40 and "top1" in stats.extra and extra["tokens"] == 12 * 12
    assert float(last) < 0.7 * float(first)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in target.parameters())  # target untouched
