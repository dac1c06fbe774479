"""Multi-process spot training (gloo + TCPStore, 3 forked workers): workers become idle
at different times, train, are preempted when the last one finishes, meet, and end
with bit-identical drafter weights equal to the samples-weighted average; a round in
which everyone finishes at once, and a rank that never trains, do not deadlock."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_tlt.dist import free_port
from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.spot.trainer import SpotTrainer, DrafterOptimConfig, SpotTrainerConfig, train_while_idle

from ._toys import regression_loss, toy_buffer, toy_model

pytestmark = pytest.mark.timeout(90)
WORLD = 3
ROLLOUT_SECONDS = [0.0, 0.5, 2.5]  # rank 2 is the long tail (wide windows: CI boxes are loaded)


def _barrier(store: dist.Store, name: str) -> None:
    if store.add(f"test/{name}", 1) == WORLD:
        store.set(f"test/{name}/open", "1")
    store.wait([f"test/{name}/open"], datetime.timedelta(seconds=30))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    try:
        # numpy arrays travel by value; torch tensors would be shared through file
        # descriptors that die with this process.
        out = _worker_body(rank, port)
        results.put({k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
    except BaseException as err:  # tell the parent instead of leaving it waiting
        results.put({"rank": rank, "error": repr(err)})
        raise


def _worker_body(rank: int, port: int) -> dict:
    import time

    store = dist.TCPStore("127.0.0.1", port, WORLD, False, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    coord = WorkerCoordinator(store, rank, WORLD, min_idle_workers=1, timeout_s=30)
    trainer = SpotTrainer(toy_model(seed=0), regression_loss, SpotTrainerConfig(batch_size=2, optim=DrafterOptimConfig(lr=1e-2, warmup_steps=0)),
                          rank=rank)
    out: dict = {"rank": rank}
    # Step 0: staggered rollouts. Ranks 0 and 1 train on their own data until rank 2,
    # the long tail, is done; rank 2 never trains.
    buf = toy_buffer(seed=10 + rank, step=0)
    _barrier(store, "start")
    time.sleep(ROLLOUT_SECONDS[rank])
    pre_sync = {}
    original_sync = trainer.synchronize

    def recording_sync(*args):
        pre_sync["weights"], pre_sync["samples"] = _flat(trainer.model), trainer.samples_since_sync
        return original_sync(*args)

    trainer.synchronize = recording_sync
    report = train_while_idle(0, coord, trainer, buf)
    out.update(pre0=pre_sync["weights"], samples0=pre_sync["samples"], post0=_flat(trainer.model),
               preempted0=report.round.preempted, latency0=report.stop_latency_s,
               training_s0=report.training_seconds, total0=report.sync.total_samples,
               moments0=_flat_moments(trainer))
    coord.mark_busy()
    _barrier(store, "policy-update-0")
    # Step 1: everyone finishes (nearly) at once; rank 1 harvested nothing.
    buf.advance_step()
    if rank == 1:
        buf.clear()
    report = train_while_idle(1, coord, trainer, buf)
    out.update(post1=_flat(trainer.model), step=trainer.step)
    dist.destroy_process_group()
    return out


def _flat_moments(trainer: SpotTrainer) -> torch.Tensor:
    state = trainer.optimizer.state
    return torch.cat([state[p][k].reshape(-1) for p in trainer.params for k in ("exp_avg", "exp_avg_sq")])


def test_idle_workers_train_get_preempted_and_end_with_identical_averaged_weights():
    port = free_port()
    # Building an optimizer imports torch._dynamo lazily (seconds); do it once here so
    # the forked workers inherit it instead of each paying for it.
    torch.optim.AdamW(toy_model().parameters())
    # fork (no torch re-import per worker); the store server starts after the fork.
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    master = dist.TCPStore("127.0.0.1", port, WORLD + 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    try:
        out = {}
        for _ in range(WORLD):
            item = results.get(timeout=80)
            assert "error" not in item, f"rank {item['rank']} failed: {item.get('error')}"
            out[item["rank"]] = {k: torch.from_numpy(v) if hasattr(v, "dtype") and hasattr(v, "shape") else v
                                 for k, v in item.items()}
        for p in procs:
            p.join(timeout=20)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del master
    # Step 0: ranks 0 and 1 trained and were preempted by the end of the rollout phase.
    assert out[0]["samples0"] > 0 and out[1]["samples0"] > 0 and out[2]["samples0"] == 0
    assert out[0]["preempted0"] and out[1]["preempted0"]
    for r in (0, 1):
        assert out[r]["latency0"] is not None and out[r]["latency0"] < 5.0  # bounded (loaded CI box)
        assert out[r]["training_s0"] > 0.0
    assert out[0]["samples0"] > out[1]["samples0"] // 4  # rank 0 had the longer window
    # Identical weights everywhere, equal to the samples-weighted average of the replicas.
    weights = torch.tensor([float(out[r]["samples0"]) for r in range(WORLD)])
    expected = sum(w * out[r]["pre0"] for r, w in enumerate(weights)) / weights.sum()
    for r in range(WORLD):
        assert torch.equal(out[r]["post0"], out[0]["post0"]), f"rank {r} differs after averaging"
        assert torch.equal(out[r]["moments0"], out[0]["moments0"])
        assert out[r]["total0"] == float(weights.sum())
    torch.testing.assert_close(out[0]["post0"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(out[0]["post0"], out[2]["pre0"])  # rank 2 received the trained drafter
    # Step 1: all at once (and one empty buffer): no deadlock, still identical.
    for r in range(WORLD):
        assert torch.equal(out[r]["post1"], out[0]["post1"])
        assert out[r]["step"] == out[0]["step"]
