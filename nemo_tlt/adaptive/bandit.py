"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit over draft-tree shapes.

Contract
--------
* Arms are :class:`~nemo_tlt.speculative.tree_shape.TreeShape` values; fastrl's
  ``"depth_topk_numverify"`` strings are parsed once, when :class:`BanditConfig`
  is constructed (the config boundary).
* The best tree shape depends on how many sequences are decoding (a deep, wide
  tree pays at batch 1 and costs too much verify compute at batch 64), so the
  bandit keeps one independent epsilon-greedy learner per batch-size *bucket*.
  With ``bucket_edges = (e0, e1, ..., en-1)`` bucket 0 holds batch sizes
  ``[1, e0)``, bucket ``i`` holds ``[e(i-1), e(i))`` and the last bucket
  ``[e(n-1), inf)``.
* Reward is throughput (tokens generated in the step / elapsed seconds). Each
  (bucket, arm) keeps a sliding window of its last ``window`` rewards, each with
  the batch size it was earned at; the greedy choice is the arm with the best
  window *median*, which shrugs off the occasional slow step (a page fault, a
  preemption) and tracks a drafter whose acceptance changes as it is retrained.
* The median is of ``reward / batch_size ** size_exponent``. Within a bucket the
  batch shrinks as rows finish, and a step's cost grows with the batch like
  ``batch ** b``, so its throughput like ``batch ** (1 - b)``; with
  ``size_exponent = 1 - b`` arms pulled at different batch sizes compare fairly
  (0: raw throughput; 1: per running row). The exponent is applied
  when ranking, not when storing, so a new estimate of b (see
  nemo_tlt.adaptive.step_cost) rescales every reward in the windows alike.
* :meth:`BegMab.select` first pulls every arm of the bucket ``min_pulls`` times
  (the least-pulled arm next, ties to the lowest index; with the default of 1:
  every untried arm, in arm order), then explores uniformly with probability
  ``epsilon``, else exploits (ties go to the lowest arm index). One decode step's
  reward is noisy (at batch 1 the accepted length of a single tree), so a median
  of one pull can bury a good arm; a few pulls each make the first ranking sound. All randomness comes from the
  ``numpy.random.Generator`` passed in; ``state_dict`` captures it so a restored
  bandit makes exactly the same future choices.
"""
from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import Any, List, Sequence

import numpy as np

from nemo_tlt.checks import check_int
from nemo_tlt.speculative.tree_shape import TreeShape, parse_arms

_STATE_VERSION = 2  # 1: windows of plain rewards (loaded as earned at batch size 1)


@dataclass(frozen=True)
class BanditConfig:
    """Arms, batch-size buckets and exploration of a :class:`BegMab` (the YAML block
    ``rollout.bandit``). ``arms`` may be given as fastrl strings (``"4_2_8"``); they are
    parsed into :class:`TreeShape` values here, once."""

    arms: List[Any] = field(default_factory=lambda: ["4_2_8", "6_2_12", "3_1_3"])
    bucket_edges: List[int] = field(default_factory=lambda: [2, 4])
    epsilon: float = 0.1
    window: int = 32
    min_pulls: int = 1

    def __post_init__(self) -> None:
        # Tuples keep the config hashable; strings become TreeShapes at this boundary only.
        object.__setattr__(self, "arms", parse_arms(self.arms, "BanditConfig"))
        object.__setattr__(self, "bucket_edges", tuple(self.bucket_edges))
        self._validate_edges()
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps <= 1.0:
            raise ValueError(f"BanditConfig.epsilon must be a number in [0, 1], got {eps!r}")
        object.__setattr__(self, "epsilon", float(eps))
        check_int("BanditConfig.window", self.window, 1)
        check_int("BanditConfig.min_pulls", self.min_pulls, 1, self.window)

    def _validate_edges(self) -> None:
        edges = self.bucket_edges
        if not edges:
            raise ValueError(
                "BanditConfig.bucket_edges must hold at least one edge (two buckets); got none"
            )
        for i, edge in enumerate(edges):
            if isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
                raise ValueError(f"BanditConfig.bucket_edges[{i}] must be a positive int, got {edge!r}")
        if edges[0] == 1:
            # The first bucket is [1, edges[0]); an edge of 1 would leave it empty,
            # which almost always means the edges were written as lower bounds.
            raise ValueError(
                "BanditConfig.bucket_edges[0]=1 makes bucket 0 ([1, 1)) empty; edges are the "
                "exclusive upper bounds of each bucket and the first bucket always starts at 1"
            )
        for i in range(1, len(edges)):
            if edges[i] <= edges[i - 1]:
                raise ValueError(
                    f"BanditConfig.bucket_edges must be strictly increasing, got "
                    f"bucket_edges[{i - 1}]={edges[i - 1]} >= bucket_edges[{i}]={edges[i]}"
                )

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_edges) + 1

    def bucket_bounds(self, bucket: int) -> tuple[int, int | None]:
        """``(lo, hi)`` batch sizes of ``bucket``: ``lo <= batch < hi``; ``hi`` is None for the last."""
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket must be in [0, {self.num_buckets}), got {bucket}")
        lo = 1 if bucket == 0 else self.bucket_edges[bucket - 1]
        hi = self.bucket_edges[bucket] if bucket < len(self.bucket_edges) else None
        return lo, hi


@dataclass(frozen=True)
class BucketStats:
    """What one bucket has learned, for logging."""

    bucket: int
    lo: int
    hi: int | None  # exclusive; None for the open-ended last bucket
    pulls: tuple[int, ...]  # per arm, in config order
    medians: tuple[float | None, ...]  # window median per arm; None while untried
    best_arm: TreeShape | None  # greedy choice now; None while nothing was tried

    @property
    def label(self) -> str:
        return f"[{self.lo},{'inf' if self.hi is None else self.hi})"

    def to_log_dict(self, arms: Sequence[TreeShape], prefix: str = "bandit") -> dict[str, float]:
        """Flat scalars (e.g. for TensorBoard): pulls and median reward per arm."""
        out: dict[str, float] = {}
        base = f"{prefix}/bucket{self.bucket}{self.label}"
        for arm, pulls, median in zip(arms, self.pulls, self.medians):
            out[f"{base}/pulls/{arm.name}"] = float(pulls)
            if median is not None:
                out[f"{base}/median_reward/{arm.name}"] = median
        if self.best_arm is not None:
            out[f"{base}/best_arm_index"] = float(list(arms).index(self.best_arm))
        return out


class BegMab:
    """Bucketed epsilon-greedy bandit choosing a draft-tree shape per decode step."""

    def __init__(self, config: BanditConfig, rng: np.random.Generator) -> None:
        if not isinstance(config, BanditConfig):
            raise ValueError(f"BegMab.config must be a BanditConfig, got {type(config).__name__}")
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"BegMab.rng must be a numpy.random.Generator, got {type(rng).__name__}")
        self.config = config
        self._rng = rng
        self._arm_index = {arm: i for i, arm in enumerate(config.arms)}
        nb, na = config.num_buckets, len(config.arms)
        self._windows: list[list[deque[tuple[float, int]]]] = [
            [deque(maxlen=config.window) for _ in range(na)] for _ in range(nb)
        ]
        self._pulls = [[0] * na for _ in range(nb)]
        self._size_exponent = 0.0

    @property
    def size_exponent(self) -> float:
        return self._size_exponent

    def set_size_exponent(self, exponent: float) -> None:
        """Rank by the median of reward / batch_size ** exponent (see the module docstring)."""
        if isinstance(exponent, bool) or not isinstance(exponent, numbers.Real) or not 0.0 <= exponent <= 1.0:
            raise ValueError(f"BegMab.size_exponent must be a number in [0, 1], got {exponent!r}")
        self._size_exponent = float(exponent)

    @property
    def arms(self) -> tuple[TreeShape, ...]:
        return self.config.arms

    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding ``batch_size`` (>= 1)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        # Buckets are [lo, hi): the bucket index is the number of edges <= batch_size.
        return int(np.searchsorted(np.asarray(self.config.bucket_edges), batch_size, side="right"))

    def select(self, batch_size: int) -> TreeShape:
        """The arm to use for a step decoding ``batch_size`` sequences."""
        bucket = self.bucket_of(batch_size)
        pulls = self._pulls[bucket]
        fewest = min(range(len(pulls)), key=lambda i: (pulls[i], i))
        if pulls[fewest] < self.config.min_pulls:
            return self.config.arms[fewest]
        # Draw the exploration coin even when epsilon is 0 or 1, so the random
        # stream (and thus restore-equivalence) never depends on epsilon's value.
        if self._rng.random() < self.config.epsilon:
            return self.config.arms[int(self._rng.integers(len(self.config.arms)))]
        return self.config.arms[self._greedy_index(bucket)]

    def update(self, batch_size: int, arm: TreeShape, reward: float) -> None:
        """Record the reward (tokens / second) of a step that used ``arm``."""
        bucket = self.bucket_of(batch_size)
        index = self._arm_index.get(arm) if isinstance(arm, TreeShape) else None
        if index is None:
            names = ", ".join(a.name for a in self.config.arms)
            raise ValueError(f"arm {arm!r} is not one of the bandit's arms ({names})")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise ValueError(f"reward must be a number, got {reward!r}")
        reward = float(reward)
        if not math.isfinite(reward) or reward < 0.0:
            raise ValueError(f"reward must be a finite throughput >= 0, got {reward!r}")
        self._windows[bucket][index].append((reward, int(batch_size)))
        self._pulls[bucket][index] += 1

    def _medians(self, bucket: int) -> list[float | None]:
        e = self._size_exponent
        return [float(np.median([r / n ** e for r, n in w])) if w else None for w in self._windows[bucket]]

    def _greedy_index(self, bucket: int) -> int:
        best, best_value = -1, -math.inf
        for i, median in enumerate(self._medians(bucket)):
            # Strict '>' keeps the lowest index on ties.
            if median is not None and median > best_value:
                best, best_value = i, median
        return best

    def bucket_stats(self, bucket: int) -> BucketStats:
        lo, hi = self.config.bucket_bounds(bucket)
        greedy = self._greedy_index(bucket)
        return BucketStats(
            bucket=bucket,
            lo=lo,
            hi=hi,
            pulls=tuple(self._pulls[bucket]),
            medians=tuple(self._medians(bucket)),
            best_arm=self.config.arms[greedy] if greedy >= 0 else None,
        )

    def stats(self) -> list[BucketStats]:
        """Per-bucket pulls, window medians and current best arm."""
        return [self.bucket_stats(b) for b in range(self.config.num_buckets)]

    def log_dict(self, prefix: str = "bandit") -> dict[str, float]:
        out: dict[str, float] = {}
        for stats in self.stats():
            out.update(stats.to_log_dict(self.config.arms, prefix))
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot: windows, pull counts and the generator state."""
        return {
            "version": _STATE_VERSION,
            "arms": [arm.name for arm in self.config.arms],
            "bucket_edges": list(self.config.bucket_edges),
            "window": self.config.window,
            "epsilon": self.config.epsilon,
            "pulls": [list(p) for p in self._pulls],
            "windows": [[[[r, n] for r, n in w] for w in bucket] for bucket in self._windows],
            "size_exponent": self._size_exponent,
            "rng": _jsonable(self._rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; refuses a state made for other arms/buckets/window."""
        if not isinstance(state, dict):
            raise ValueError(f"bandit state must be a dict, got {type(state).__name__}")
        if state.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"bandit state 'version'={state.get('version')!r} is not one this bandit reads "
                             f"(1 or {_STATE_VERSION})")
        _check_match(state, "arms", [arm.name for arm in self.config.arms])
        _check_match(state, "bucket_edges", list(self.config.bucket_edges))
        _check_match(state, "window", self.config.window)
        pulls, windows = self._parse_counts(state)
        exponent = state.get("size_exponent", self._size_exponent)
        rng_state = state.get("rng")
        generator = type(self._rng.bit_generator).__name__
        if not isinstance(rng_state, dict) or rng_state.get("bit_generator") != generator:
            raise ValueError(f"bandit state 'rng' does not match this bandit's generator ({generator})")
        self.set_size_exponent(exponent)
        self._rng.bit_generator.state = rng_state
        self._pulls = pulls
        self._windows = [[deque(w, maxlen=self.config.window) for w in bucket] for bucket in windows]

    def _parse_counts(self, state: dict[str, Any]) -> tuple[list[list[int]], list[list[list[tuple[float, int]]]]]:
        nb, na = self.config.num_buckets, len(self.config.arms)
        pulls, windows = state.get("pulls"), state.get("windows")
        if not _is_grid(pulls, nb, na) or not _is_grid(windows, nb, na):
            raise ValueError(f"bandit state 'pulls' and 'windows' must be {nb} buckets x {na} arms")
        pairs = state["version"] != 1  # version 1: plain rewards, normalised as they were earned
        for b in range(nb):
            for a in range(na):
                count, window = pulls[b][a], windows[b][a]
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise ValueError(f"bandit state 'pulls'[{b}][{a}] must be an int >= 0, got {count!r}")
                if not isinstance(window, list) or len(window) != min(count, self.config.window):
                    raise ValueError(
                        f"bandit state 'windows'[{b}][{a}] must hold min(pulls, window) rewards"
                    )
                if pairs and not all(isinstance(e, list) and len(e) == 2 and isinstance(e[1], int) and e[1] >= 1
                                     for e in window):
                    raise ValueError(f"bandit state 'windows'[{b}][{a}] must hold [reward, batch_size >= 1] pairs")
        if not pairs:
            return [list(p) for p in pulls], [[[(float(r), 1) for r in w] for w in bucket] for bucket in windows]
        return (
            [list(p) for p in pulls],
            [[[(float(r), int(n)) for r, n in w] for w in bucket] for bucket in windows],
        )


def _check_match(state: dict[str, Any], key: str, expected: Any) -> None:
    if key not in state:
        raise ValueError(f"bandit state has no '{key}'")
    if state[key] != expected:
        raise ValueError(
            f"bandit state '{key}'={state[key]!r} does not match this bandit's config ({expected!r})"
        )


def _is_grid(value: Any, rows: int, cols: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == rows
        and all(isinstance(row, list) and len(row) == cols for row in value)
    )


def _jsonable(value: Any) -> Any:
    """Deep-copy a numpy bit-generator state into plain dict/list/int/float/str."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
