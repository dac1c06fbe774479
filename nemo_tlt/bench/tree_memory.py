"""The host memory a process's descendants add (forked checkpoint writers, a results-queue server),
sampled: what ``nemo-tlt bench checkpoint`` adds to the rank's own ``VmHWM``.

Contract: ``ChildrenPeak`` (a context manager, sampling from a thread of the measured process)
keeps two peaks of the descendants' memory, each the peak over samples every ``interval_s``:

* ``peak`` (the figure): the anonymous pages only descendants map, no longer the measured
  process's: ``sum(Pss_Anon over descendants) + Pss_Anon(self) - Anonymous(self)``. The anonymous
  pages of the process tree number ``sum(Pss_Anon)`` over it (nothing outside it maps them: the
  process was spawned), and the process maps ``Anonymous(self)`` of them. A page the process
  rewrites while forked descendants map it is copied (copy on write): the process maps the
  copy, and the old page stays with the descendants, shared by every one of them still alive;
  this counts it once.
* ``private_peak``: the descendants' summed private resident bytes (``Private_Clean +
  Private_Dirty``), the measure before: it misses a page two descendants share and the process
  no longer maps (megatron-core's writer forks its own writers, so the copies an update makes
  during a write are such pages). Kept to show the difference.

``peak`` needs a measured process that shares no anonymous page with a process outside its
tree (a spawned one): a process forked from a parent that still lives shares the parent's pages,
so ``Pss_Anon(self) - Anonymous(self)`` is negative by far more than its descendants add, and
forking a descendant shifts those shares again. ``outside_shared_bytes`` (``Anonymous -
Pss_Anon`` of the process at ``__enter__``, when it has no descendants) says which case holds:
``pss_valid`` is True when it is 0; the figure is then ``peak``, else ``private_peak``
(``figure`` and ``measure`` name it).

Not counted: page cache (the written files), file-backed pages. Linux only (``smaps_rollup``).
"""
from __future__ import annotations

import threading
import time

_FIELDS = ("Pss_Anon", "Anonymous", "Private_Clean", "Private_Dirty")


def rollup(pid: int) -> dict[str, int] | None:
    """A process's ``/proc/<pid>/smaps_rollup`` fields in bytes; None if it exited meanwhile."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            got = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
                   if k in _FIELDS}
    except (FileNotFoundError, ProcessLookupError):
        return None
    return got if len(got) == len(_FIELDS) else None


def descendants_only_bytes(mine: dict[str, int], kids: list[dict[str, int]]) -> int:
    """Anonymous bytes the descendants map and the process does not (see the module docstring).
    The reads are not one snapshot: a page copied between them may be undercounted in that sample
    (the process's own figure is read first), and a later sample sees it."""
    if not kids:
        return 0
    return max(0, sum(k["Pss_Anon"] for k in kids) + mine["Pss_Anon"] - mine["Anonymous"])


def private_bytes(kids: list[dict[str, int]]) -> int:
    return sum(k["Private_Clean"] + k["Private_Dirty"] for k in kids)


class ChildrenPeak:
    """Samples this process's descendants every ``interval_s`` and keeps ``peak`` and
    ``private_peak`` (see the module docstring), the number of ``samples`` taken and of samples
    ``dropped`` (a descendant started or ended meanwhile), and ``live``: the number of live
    descendants at each change, with the seconds since ``__enter__``."""

    def __init__(self, interval_s: float = 0.01) -> None:
        import psutil

        self._me, self._interval = psutil.Process(), interval_s
        self.peak = self.private_peak = self.samples = self.dropped = 0
        self.outside_shared_bytes: int | None = None  # set at __enter__
        self.live: list[tuple[float, int]] = []  # (seconds since enter, live descendants) at each change
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _descendants(self) -> list[int] | None:
        """Live descendants' pids (a zombie has exited: it maps nothing), or None if the listing failed."""
        import psutil

        try:
            kids = self._me.children(recursive=True)
            return sorted(k.pid for k in kids if k.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return None

    def sample(self) -> bool:
        """One sample; dropped (False) when a descendant started or ended while it was read: the
        shares (``Pss``) of the ones read before and after it would not add up."""
        pids = self._descendants()
        if pids is None:
            self.dropped += 1
            return False
        if not self.live or self.live[-1][1] != len(pids):
            self.live.append((round(time.perf_counter() - self._start, 3), len(pids)))
        if not pids:
            self.samples += 1
            return True
        mine = rollup(self._me.pid)
        kids = [rollup(pid) for pid in pids]
        if mine is None or None in kids or self._descendants() != pids:
            self.dropped += 1
            return False
        self.peak = max(self.peak, descendants_only_bytes(mine, kids))
        self.private_peak = max(self.private_peak, private_bytes(kids))
        self.samples += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)

    @property
    def pss_valid(self) -> bool:
        """Whether ``peak`` counts what it says (see the module docstring)."""
        return self.outside_shared_bytes == 0

    @property
    def measure(self) -> str:
        return "pss_anon" if self.pss_valid else "private"

    @property
    def figure(self) -> int:
        """``peak`` where it is valid, else ``private_peak`` (a lower bound)."""
        return self.peak if self.pss_valid else self.private_peak

    def __enter__(self) -> "ChildrenPeak":
        mine = rollup(self._me.pid)
        if mine is not None and self._descendants() == []:  # with descendants, their shares hide the outside's
            self.outside_shared_bytes = mine["Anonymous"] - mine["Pss_Anon"]
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
