"""Tests for nemo_tlt.spot.coordinator: state machine, preemption, rendezvous, timelines.

In-process tests share one HashStore between several coordinators; the multi-process
test runs three forked workers over a real TCPStore.
"""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_tlt.dist import free_port
from nemo_tlt.spot.coordinator import (
    TimelineEvent,
    WorkerCoordinator,
    WorkerState,
    idle_utilization,
    state_durations,
)

pytestmark = pytest.mark.timeout(60)


def _group(world_size: int, min_idle: int, timeout_s: float = 10.0) -> list[WorkerCoordinator]:
    store = dist.HashStore()
    return [WorkerCoordinator(store, r, world_size, min_idle, timeout_s=timeout_s) for r in range(world_size)]


def test_constructor_validation():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="rank"):
        WorkerCoordinator(store, 3, 3, 1)
    with pytest.raises(ValueError, match="min_idle_workers"):
        WorkerCoordinator(store, 0, 3, 4)
    with pytest.raises(ValueError, match="world_size"):
        WorkerCoordinator(store, 0, 0, 1)


def test_should_train_needs_min_idle_workers_and_training_counts_as_idle():
    c = _group(4, min_idle=2)
    c[0].mark_idle()
    assert c[0].idle_workers() == 1 and not c[0].should_train()
    c[1].mark_idle()
    assert c[0].should_train() and c[1].should_train()
    c[0].start_training()
    assert c[0].state is WorkerState.TRAINING
    assert c[1].should_train() and c[0].idle_workers() == 2
    assert not c[2].should_train()  # BUSY ranks never train
    with pytest.raises(ValueError, match="not IDLE"):
        c[2].start_training()


def test_mark_busy_and_remote_request_preempt():
    c = _group(3, min_idle=1)
    c[0].mark_idle()
    c[0].start_training()
    assert not c[0].preempt_requested()
    c[0].mark_busy()
    assert c[0].preempt_requested() and c[0].state is WorkerState.BUSY
    assert c[0].idle_workers() == 0
    c[1].mark_idle()
    c[1].start_training()
    c[2].request_preemption(1)  # another process (here: another coordinator) asks
    assert c[1].preempt_requested()
    assert not c[2].preempt_requested()


def test_last_rank_done_preempts_everyone_even_between_check_and_start():
    c = _group(3, min_idle=1)
    c[0].mark_idle()
    assert c[0].should_train()
    c[1].mark_idle()
    c[1].start_training()
    c[2].mark_idle()  # the rollout phase is over
    c[0].start_training()  # decided before the request landed: must still see it
    assert c[0].preempt_requested() and c[1].preempt_requested()
    assert not c[2].should_train()


def test_wait_for_work_wakes_on_idle_and_on_preempt():
    c = _group(3, min_idle=2)
    c[0].mark_idle()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(c[0].wait_for_work(timeout_s=10)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # blocked, not returning early
    c[1].mark_idle()
    waiter.join(timeout=5)
    assert result == [True]

    c = _group(3, min_idle=3)
    c[0].mark_idle()
    result = []
    waiter = threading.Thread(target=lambda: result.append(c[0].wait_for_work(timeout_s=10)))
    waiter.start()
    c[2].request_preemption(0)
    waiter.join(timeout=5)
    assert result == [False]

    c = _group(2, min_idle=2)
    c[0].mark_idle()
    with pytest.raises(TimeoutError, match="1 of 2 required idle workers"):
        c[0].wait_for_work(timeout_s=0.2)


def test_meet_rendezvous_and_next_step_resets_preemption():
    c = _group(2, min_idle=1)
    c[0].mark_idle()
    c[0].start_training()
    done: list[int] = []
    t = threading.Thread(target=lambda: (c[0].meet(0), done.append(0)))
    t.start()
    time.sleep(0.05)
    assert not done  # waits for rank 1
    c[1].meet(0)  # rank 1 never marked idle: arriving counts as done
    t.join(timeout=5)
    assert done == [0] and c[0].state is WorkerState.IDLE and c[1].state is WorkerState.IDLE
    for coord in c:
        coord.mark_busy()
    c[0].mark_idle()
    assert not c[0].preempt_requested() and c[0].should_train()


def test_meet_keys_of_old_steps_are_deleted_and_timelines_collected():
    c = _group(2, min_idle=1)
    store = c[0].store
    for step in range(3):
        t = threading.Thread(target=c[1].meet, args=(step,))
        t.start()
        c[0].meet(step)
        t.join(timeout=5)
        if step == 1:
            events = c[0].collect_timelines(1)
            assert {e.rank for e in events} == {0, 1}
    assert not store.check(["tlt/spot/meet/0"]) and not store.check(["tlt/spot/timeline/0/1"])
    assert store.check(["tlt/spot/meet/2", "tlt/spot/timeline/1/0"])


def test_meet_times_out_naming_the_step():
    c = _group(2, min_idle=1)
    with pytest.raises(TimeoutError, match=r"meet\(7\)"):
        c[0].meet(7, timeout_s=0.2)


def test_timeline_and_state_durations_with_fake_clock():
    now = [100.0]
    store = dist.HashStore()
    c = WorkerCoordinator(store, 0, 1, 1, clock=lambda: now[0])
    now[0] = 101.0
    c.mark_idle()  # the only rank: the phase is over at once, training is preempted
    assert c.preempt_requested() and not c.should_train()
    now[0] = 102.5
    c.mark_busy()
    assert [(e.state, e.time) for e in c.timeline] == [
        (WorkerState.BUSY, 100.0),
        (WorkerState.IDLE, 101.0),
        (WorkerState.BUSY, 102.5),
    ]
    d = c.durations(100.0, 103.0)
    assert d == {WorkerState.BUSY: 1.5, WorkerState.IDLE: 1.5, WorkerState.TRAINING: 0.0}


def test_state_durations_sums_ranks_and_clips_window():
    ev = [
        TimelineEvent(0, WorkerState.BUSY, 0.0),
        TimelineEvent(0, WorkerState.IDLE, 2.0),
        TimelineEvent(0, WorkerState.TRAINING, 3.0),
        TimelineEvent(1, WorkerState.BUSY, 0.0),
        TimelineEvent(1, WorkerState.IDLE, 5.0),
    ]
    d = state_durations(ev, 1.0, 6.0)
    assert d == {WorkerState.BUSY: 1.0 + 4.0, WorkerState.IDLE: 1.0 + 1.0, WorkerState.TRAINING: 3.0}
    assert idle_utilization(d) == pytest.approx(3.0 / 5.0)
    assert idle_utilization({s: 0.0 for s in WorkerState}) == 0.0
    with pytest.raises(ValueError, match="before start"):
        state_durations(ev, 2.0, 1.0)


# ------------------------------------------------------------------ multi-process

def _barrier(store: dist.Store, world_size: int, name: str) -> None:
    if store.add(f"test/{name}", 1) == world_size:
        store.set(f"test/{name}/open", "1")
    store.wait([f"test/{name}/open"], datetime.timedelta(seconds=30))


def _worker(rank: int, world_size: int, port: int, results) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    try:
        results.put(_worker_body(rank, world_size, port))
    except BaseException as err:  # report to the parent instead of leaving it waiting
        results.put((rank, "error", repr(err), []))
        raise


def _worker_body(rank: int, world_size: int, port: int) -> tuple:
    store = dist.TCPStore("127.0.0.1", port, world_size, False, datetime.timedelta(seconds=30))
    coord = WorkerCoordinator(store, rank, world_size, min_idle_workers=2, timeout_s=30)
    _barrier(store, world_size, "start")
    # Step 0: staggered rollouts; rank 2 is the long tail and never marks itself idle.
    steps = 0
    time.sleep([0.0, 0.3, 1.0][rank])
    if rank != 2:
        coord.mark_idle()
        if coord.wait_for_work():
            coord.start_training()
            while not coord.preempt_requested():
                time.sleep(0.005)  # one simulated micro-step
                steps += 1
    coord.meet(0)
    timelines = coord.collect_timelines(0) if rank == 0 else []
    coord.mark_busy()
    _barrier(store, world_size, "policy-update")  # the collective policy update
    # Step 1: everyone is done (nearly) at once: whoever starts training is preempted
    # as soon as the last rank is idle, and nobody hangs.
    coord.mark_idle()
    if coord.wait_for_work():
        coord.start_training()
        while not coord.preempt_requested():
            time.sleep(0.005)
    coord.meet(1)
    trained_step1 = coord.preempt_requested()
    return rank, steps, trained_step1, [(e.rank, e.state.value, e.time) for e in timelines]


def test_multiprocess_tcpstore_staggered_idle_train_preempt_meet():
    world_size = 3
    port = free_port()
    # fork: no re-import of torch per worker (seconds each on a loaded machine). The
    # store server starts only after the fork, so no server thread is forked; the
    # clients retry their connection until it is up.
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    master = dist.TCPStore("127.0.0.1", port, world_size + 1, True, datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    try:
        out = {}
        for _ in range(world_size):
            rank, steps, trained_step1, timelines = results.get(timeout=50)
            assert steps != "error", f"rank {rank} failed: {trained_step1}"
            out[rank] = (steps, trained_step1, timelines)
        for p in procs:
            p.join(timeout=10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del master
    assert out[0][0] > 0 and out[1][0] > 0, "idle ranks should have trained while rank 2 was busy"
    assert out[2][0] == 0
    assert all(out[r][1] for r in range(world_size)), "every rank sees the end of the rollout phase"
    events = [TimelineEvent(r, WorkerState(s), t) for r, s, t in out[0][2]]
    first = {(e.rank, e.state): e.time for e in reversed(events)}
    # Rank 0 waited for a second idle worker before training (min_idle_workers=2).
    assert first[(0, WorkerState.TRAINING)] >= first[(1, WorkerState.IDLE)]
    assert (2, WorkerState.TRAINING) not in first
    d = state_durations(events, min(e.time for e in events), max(e.time for e in events))
    assert d[WorkerState.TRAINING] > 0.5  # about 0.7 s x 2 ranks of training in the window


def test_request_counted_but_not_yet_stamped_does_not_block_a_shared_tcpstore():
    """The requester counts a preemption, then stamps it. A check landing between the two
    must not wait for the stamp: with one TCPStore client shared by two threads (the RL
    loop and the drafter trainer of one process) a `get` on the missing stamp holds the
    client, so the requester's `set` of it would wait until the Store timed out."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    worker = WorkerCoordinator(store, 0, 2, prefix="t/stamp", timeout_s=30, clock=lambda: 123.0)
    worker.mark_idle()
    store.add("t/stamp/preempt/0", 1)           # counted; the stamp is not there yet
    # a check that waited for the stamp would end in the Store's timeout error, not True
    assert worker.preempt_requested()
    assert worker.preempt_requested_at == 123.0  # our own clock stands in for the stamp
    # And a stamped request still reports the requester's time.
    other = WorkerCoordinator(store, 1, 2, prefix="t/stamp", timeout_s=30, clock=lambda: 7.0)
    worker.mark_busy()
    worker.mark_idle()
    other.request_preemption(0)
    assert worker.preempt_requested() and worker.preempt_requested_at == 7.0
