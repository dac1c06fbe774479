"""`WorkerCoordinator`: who owns each worker's device (BUSY / IDLE / TRAINING).

Contract
--------
* Every rank holds one coordinator over a shared ``torch.distributed.Store``
  (``TCPStore`` across processes and nodes; ``HashStore`` inside one process for
  tests). All shared state is Store counters and keys under a namespace prefix,
  so several coordinators (e.g. one per RL run) can share one store.
* The RL loop drives transitions: ``mark_idle()`` when this rank's rollout share is
  done, ``mark_busy()`` when rollout or the policy update needs the device,
  ``start_training()`` when ``should_train()`` says enough workers are idle.
  Timers never change states.
* Preemption: ``mark_busy()`` (this rank, any thread of this process) and
  ``request_preemption(rank)`` (any process) ask a training rank to stop.
  Also, once *every* rank is done with its rollout share (all IDLE/TRAINING, or
  arrived at ``meet``) the rollout phase is over and all training is preempted,
  so the ranks can meet and hand the devices to the policy update.
  ``preempt_requested()`` is the hot-path check between micro-steps: a local
  flag, then one Store ``add(key, 0)`` read (one round trip); no sleeping, no
  polling loop.
* The preemption baseline is taken when a rank becomes idle, not when training
  starts, so a request that lands between ``should_train()`` and
  ``start_training()`` is never lost.
* ``wait_for_work()`` lets an idle rank block (event-driven, Store ``wait`` on a
  generation key) until it may train or is preempted; ``meet(step)`` is the
  end-of-rollout rendezvous of all ranks; both take a timeout and raise
  ``TimeoutError`` naming what was missing instead of hanging forever.
* Between ``meet(step)`` and this rank's next ``mark_idle()`` every rank calls
  ``mark_busy()`` (the policy update is a collective, so all ranks do so before any
  rank finishes its next rollout share); the idle count is only meaningful then.
* Each coordinator records its own state changes with wall-clock timestamps
  (``timeline``); ``state_durations`` turns a timeline into worker-seconds per state
  (idle worker-seconds, drafter-training worker-seconds) for metrics and plots.
  ``meet`` publishes the timeline so rank 0 can ``collect_timelines``.

Store keys per step (meet counters, published timelines) are deleted two steps
later; the wake-up keys ``events/<n>`` (one per state change, tens of bytes) are kept.
Blocking waits go through a cloned Store connection: a TCPStore client serialises
its operations, so a wait on the shared client would stall the hot-path check.
"""
from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist


class WorkerState(enum.Enum):
    BUSY = "busy"  # rollout or policy update owns the device
    IDLE = "idle"  # rollout share done; may train the drafter
    TRAINING = "training"  # training the drafter on idle time; preemptible


@dataclass(frozen=True)
class TimelineEvent:
    rank: int
    state: WorkerState
    time: float  # seconds, from the coordinator's clock (wall clock by default)


class WorkerCoordinator:
    """One rank's view of the shared worker states. See the module docstring."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        min_idle_workers: int = 1,
        prefix: str = "tlt/spot",
        timeout_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"WorkerCoordinator.world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"WorkerCoordinator.rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(min_idle_workers, int) or not 1 <= min_idle_workers <= world_size:
            raise ValueError(
                f"WorkerCoordinator.min_idle_workers must be in [1, world_size={world_size}], got {min_idle_workers!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"WorkerCoordinator.timeout_s must be > 0, got {timeout_s!r}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.min_idle_workers = min_idle_workers
        self.prefix = prefix.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._wait_store: dist.Store | None = None
        self._wait_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._local_preempt = threading.Event()
        self._preempt_base = 0
        self._preempt_requested_at: float | None = None
        self._state = WorkerState.BUSY
        self._events: list[TimelineEvent] = []
        self._published_from = 0  # first timeline event the next meet publishes
        self._record(WorkerState.BUSY)

    # ---------------------------------------------------------------- state changes

    @property
    def state(self) -> WorkerState:
        return self._state

    def mark_idle(self) -> None:
        """This rank's rollout share is done. No-op when already IDLE or TRAINING."""
        with self._state_lock:
            if self._state is not WorkerState.BUSY:
                return
            self._become_idle()

    def start_training(self) -> None:
        """IDLE -> TRAINING. The caller checked `should_train()`; training stops at `preempt_requested()`."""
        with self._state_lock:
            if self._state is not WorkerState.IDLE:
                raise ValueError(f"WorkerCoordinator.start_training: rank {self.rank} is {self._state.name}, not IDLE")
            self._set_state(WorkerState.TRAINING)

    def stop_training(self) -> None:
        """TRAINING -> IDLE after the trainer returned (preempted or out of data). No-op otherwise."""
        with self._state_lock:
            if self._state is WorkerState.TRAINING:
                self._set_state(WorkerState.IDLE)

    def mark_busy(self) -> None:
        """Rollout or the policy update needs this device: preempt this rank's training at once."""
        with self._state_lock:
            if self._state is WorkerState.BUSY:
                return
            if not self._local_preempt.is_set():
                self._preempt_requested_at = self._clock()
            self._local_preempt.set()
            self._bump_preempt(self.rank)
            self.store.add(self._key("nonbusy"), -1)
            self._set_state(WorkerState.BUSY)
        self._notify()

    def request_preemption(self, rank: int) -> None:
        """Ask `rank` (in any process) to stop training; it sees this at its next `preempt_requested()`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"WorkerCoordinator.request_preemption: rank {rank} not in [0, {self.world_size})")
        self._bump_preempt(rank)
        self._notify()

    # ------------------------------------------------------------------- queries

    def now(self) -> float:
        """The coordinator's clock (timeline and latency timestamps)."""
        return self._clock()

    @property
    def preempt_requested_at(self) -> float | None:
        """When the first preemption request since this rank became idle was made (the
        requester's clock), once `preempt_requested()` has seen it; else None."""
        return self._preempt_requested_at if self._local_preempt.is_set() else None

    def idle_workers(self) -> int:
        """Ranks currently IDLE or TRAINING (one Store read)."""
        return int(self.store.add(self._key("nonbusy"), 0))

    def preempt_requested(self) -> bool:
        """Hot-path check between micro-steps: has anyone asked this rank to stop since it became idle?"""
        if self._local_preempt.is_set():
            return True
        if self.store.add(self._key(f"preempt/{self.rank}"), 0) > self._preempt_base:
            # Latch it, so later checks cost no Store round trip. The requester stamps
            # each request right after counting it; read the first stamp after our
            # baseline for latency metrics. Never wait for a stamp not written yet: a
            # Store `get` blocks on a missing key while holding the client, so with the
            # requester in this process (the RL loop's thread, sharing the Store) its
            # `set` of that stamp would wait behind us until the Store timed out.
            key = self._key(f"preempt/{self.rank}/{self._preempt_base + 1}")
            stamp = self.store.get(key) if self.store.check([key]) else None
            self._preempt_requested_at = float(stamp.decode()) if stamp is not None else self._clock()
            self._local_preempt.set()
            return True
        return False

    def should_train(self) -> bool:
        """True when this rank is IDLE, at least `min_idle_workers` ranks are IDLE/TRAINING,
        and the rollout phase is not over (no preemption pending for this rank)."""
        if self._state is not WorkerState.IDLE or self.preempt_requested():
            return False
        return self.idle_workers() >= self.min_idle_workers

    def wait_for_work(self, timeout_s: float | None = None) -> bool:
        """Block while IDLE until training may start (True) or this rank is preempted /
        no longer IDLE (False). Event-driven: wakes on any state change in the group."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            generation = int(self.store.add(self._key("events"), 0))
            if self.should_train():
                return True
            if self._state is not WorkerState.IDLE or self.preempt_requested():
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._blocking_wait(self._key(f"events/{generation + 1}"), remaining):
                raise TimeoutError(
                    f"WorkerCoordinator.wait_for_work: rank {self.rank} waited {limit:.1f}s with "
                    f"{self.idle_workers()} of {self.min_idle_workers} required idle workers and no preemption"
                )

    # ------------------------------------------------------------------ rendezvous

    def meet(self, step: int, timeout_s: float | None = None) -> None:
        """End-of-rollout rendezvous of all ranks for RL step `step`.

        Arriving means this rank's rollout share is done (BUSY ranks become IDLE) and its
        training, if any, has stopped (TRAINING ranks become IDLE). Arrival may complete
        the rollout phase and so preempt the others. Publishes this rank's timeline since
        the previous meet. Afterwards the RL loop calls `mark_busy()` for the policy update.
        """
        with self._state_lock:
            if self._state is WorkerState.BUSY:
                self._become_idle()
            elif self._state is WorkerState.TRAINING:
                self._set_state(WorkerState.IDLE)
        self.store.set(self._key(f"timeline/{step}/{self.rank}"), self._timeline_json())
        arrived = int(self.store.add(self._key(f"meet/{step}"), 1))
        if arrived == self.world_size:
            self.store.set(self._key(f"meet/{step}/open"), "1")
        waited = self.timeout_s if timeout_s is None else timeout_s
        self._wait_or_raise(self._key(f"meet/{step}/open"), waited, f"all {self.world_size} ranks at meet({step})")
        # Bound the store's size: every rank is past meet(step - 1), so nobody still
        # waits on meet(step - 2) or collects its timelines.
        self.store.delete_key(self._key(f"timeline/{step - 2}/{self.rank}"))
        if self.rank == 0:
            self.store.delete_key(self._key(f"meet/{step - 2}"))
            self.store.delete_key(self._key(f"meet/{step - 2}/open"))

    def collect_timelines(self, step: int) -> list[TimelineEvent]:
        """All ranks' timelines as published at `meet(step)`, merged and sorted by time."""
        events: list[TimelineEvent] = []
        for rank in range(self.world_size):
            key = self._key(f"timeline/{step}/{rank}")
            self._wait_or_raise(key, self.timeout_s, f"rank {rank}'s timeline for step {step}")
            for state, t in json.loads(self.store.get(key)):
                events.append(TimelineEvent(rank=rank, state=WorkerState(state), time=float(t)))
        return sorted(events, key=lambda e: (e.time, e.rank))

    # ------------------------------------------------------------------- timeline

    @property
    def timeline(self) -> list[TimelineEvent]:
        return list(self._events)

    def durations(self, start: float, end: float | None = None) -> dict[WorkerState, float]:
        """Seconds this rank spent in each state within [start, end] (end defaults to now)."""
        return state_durations(self._events, start, self._clock() if end is None else end)

    # ------------------------------------------------------------------ internals

    def _become_idle(self) -> None:
        # Baseline first, then the count: a preemption caused by this very arrival
        # (the last rank becoming idle) must count as "after" the baseline.
        self._preempt_base = int(self.store.add(self._key(f"preempt/{self.rank}"), 0))
        self._local_preempt.clear()
        self._preempt_requested_at = None
        self._set_state(WorkerState.IDLE)
        nonbusy = int(self.store.add(self._key("nonbusy"), 1))
        if nonbusy >= self.world_size:
            # Every rank is done with its rollout share: the rollout phase is over, the
            # policy update is next, so all drafter training must yield.
            for rank in range(self.world_size):
                self._bump_preempt(rank)
        self._notify()

    def _bump_preempt(self, rank: int) -> None:
        """Raise `rank`'s preemption generation and stamp the request with our clock."""
        generation = int(self.store.add(self._key(f"preempt/{rank}"), 1))
        self.store.set(self._key(f"preempt/{rank}/{generation}"), repr(self._clock()))

    def _set_state(self, state: WorkerState) -> None:
        self._state = state
        self.store.set(self._key(f"state/{self.rank}"), state.value)
        self._record(state)

    def _record(self, state: WorkerState) -> None:
        self._events.append(TimelineEvent(rank=self.rank, state=state, time=self._clock()))

    def _notify(self) -> None:
        """Wake every `wait_for_work` in the group: bump the generation, then create its key."""
        generation = int(self.store.add(self._key("events"), 1))
        self.store.set(self._key(f"events/{generation}"), "1")

    def _blocking_wait(self, key: str, timeout_s: float) -> bool:
        """Block until `key` exists (True) or `timeout_s` passes (False)."""
        with self._wait_lock:
            if self._wait_store is None:
                self._wait_store = self.store.clone()
            try:
                self._wait_store.wait([key], timedelta(seconds=max(timeout_s, 1e-3)))
            except dist.DistStoreError:
                return False
            return True

    def _wait_or_raise(self, key: str, timeout_s: float, what: str) -> None:
        if not self._blocking_wait(key, timeout_s):
            raise TimeoutError(
                f"WorkerCoordinator: rank {self.rank} timed out after {timeout_s:.1f}s waiting for {what}"
            )

    def _timeline_json(self) -> str:
        """Events since the previous meet, starting with the state in force then."""
        window = self._events[self._published_from :]
        self._published_from = len(self._events) - 1
        return json.dumps([[e.state.value, e.time] for e in window])

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"


def state_durations(events: list[TimelineEvent], start: float, end: float) -> dict[WorkerState, float]:
    """Worker-seconds per state within [start, end] from one or more ranks' timelines.

    Each rank's state holds from its event until its next event (or `end`); the state in
    force at `start` is the last event at or before it. Summing over ranks gives
    worker-seconds, e.g. idle worker-seconds and drafter-training worker-seconds.
    """
    if end < start:
        raise ValueError(f"state_durations: end={end} is before start={start}")
    totals = {state: 0.0 for state in WorkerState}
    by_rank: dict[int, list[TimelineEvent]] = {}
    for event in sorted(events, key=lambda e: e.time):
        by_rank.setdefault(event.rank, []).append(event)
    for rank_events in by_rank.values():
        for i, event in enumerate(rank_events):
            until = rank_events[i + 1].time if i + 1 < len(rank_events) else end
            lo, hi = max(event.time, start), min(until, end)
            if hi > lo:
                totals[event.state] += hi - lo
    return totals


def idle_utilization(durations: dict[WorkerState, float]) -> float:
    """Fraction of non-busy worker time spent training the drafter (0 when nothing was idle)."""
    idle_time = durations[WorkerState.IDLE] + durations[WorkerState.TRAINING]
    return durations[WorkerState.TRAINING] / idle_time if idle_time > 0 else 0.0
