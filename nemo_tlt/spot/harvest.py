"""`HarvestBuffer`: drafter training data harvested from rollouts.

Contract
--------
* A sample is one rollout sequence (prompt + response): ``token_ids`` (int64 ``[L]``)
  and ``hidden``, the target's last-layer hidden states *after the final norm*.
  ``hidden[t]`` is the state at position ``t``, the one the target used to predict
  token ``t + 1`` (EAGLE features: the drafter learns ``(hidden[t], token[t+1]) ->
  hidden[t+1]`` and the next token). Stored with ``L - 1`` rows, the layout of
  ``RequestResult.hidden_states`` and ``drafter.data.DrafterSample``; ``add`` also
  takes ``L`` rows and drops the last one, which predicts a token beyond the sample.
  Optionally the target's top-k logits per position (``topk_values`` float and
  ``topk_indices`` int64, ``[L - 1, k]`` or ``[L, k]`` like ``hidden``) for
  distillation losses; when ``HarvestConfig.topk > 0`` every sample carries them.
* Hidden states are stored compactly on the host (bf16 or fp16, per config), always
  as a private copy: a row sliced out of an engine's big batch tensor would
  otherwise keep the whole batch alive and the byte accounting would lie. On a GPU
  rank that is one device-to-host copy per harvested sequence: the rollout's device
  memory is not held for drafter data; the loss moves each training batch to the
  drafter's device (``spot.losses``).
* The buffer is bounded by bytes; when full it evicts the oldest samples first.
* It is recency-weighted: every sample is tagged with the RL step that produced it.
  ``advance_step()`` moves to the next step and drops samples ``keep_steps`` or more
  steps old (with the default 2: the current step and the one before survive).
  ``sample_batch`` draws samples with weight ``recency_decay ** age``.
* Shapes that disagree with the configured drafter (hidden size, lengths, top-k)
  are refused with a ValueError naming the argument; nothing is dropped silently.

The buffer is not thread-safe; the RL loop fills it and the spot trainer reads it
from the same thread, between rollout and training.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.drafter.data import DrafterSample

_STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class HarvestConfig:
    """hidden_size: the target's (= drafter's) hidden size H.
    max_bytes: bound on the host memory held by the samples (tensor payload).
    keep_steps: how many RL steps a sample lives (2: this step and the one before).
    recency_decay: sampling weight multiplier per step of age (1.0 = uniform).
    hidden_dtype: storage dtype of hidden states ('bfloat16' | 'float16' | 'float32').
    topk: target logits kept per position (0 = none).
    min_length: shortest accepted sample in tokens; EAGLE needs 3 for one training pair
        (x_{t+1}, f_t) -> f_{t+1}.
    """

    hidden_size: int
    max_bytes: int = 512 * 1024 * 1024
    keep_steps: int = 2
    recency_decay: float = 0.5
    hidden_dtype: str = "bfloat16"
    topk: int = 0
    min_length: int = 3

    def __post_init__(self) -> None:
        for name in ("hidden_size", "max_bytes", "keep_steps"):
            check_int(f"HarvestConfig.{name}", getattr(self, name), 1)
        check_int("HarvestConfig.min_length", self.min_length, 2)
        check_int("HarvestConfig.topk", self.topk, 0)
        check_float("HarvestConfig.recency_decay", self.recency_decay, 0, 1, lo_open=True)
        if self.hidden_dtype not in _STORAGE_DTYPES:
            raise ValueError(
                f"HarvestConfig.hidden_dtype must be one of {sorted(_STORAGE_DTYPES)}, got {self.hidden_dtype!r}"
            )

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE_DTYPES[self.hidden_dtype]


@dataclass(frozen=True)
class HarvestSample:
    """One harvested sequence, host-resident. See the module docstring for the layout."""

    token_ids: torch.Tensor
    hidden: torch.Tensor
    step: int
    topk_values: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    def to_drafter_sample(self) -> DrafterSample:
        """The drafter's training view (hidden states as stored, e.g. bf16; the loss casts)."""
        return DrafterSample(tokens=self.token_ids, hidden=self.hidden)

    @property
    def nbytes(self) -> int:
        tensors = (self.token_ids, self.hidden, self.topk_values, self.topk_indices)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class HarvestStats:
    """A snapshot of the buffer: what it holds now and what it did since creation."""

    bytes: int
    samples: int
    tokens: int
    current_step: int
    added: int
    evicted_for_space: int
    dropped_stale: int


class HarvestBuffer:
    """Byte-bounded, recency-weighted store of drafter training samples."""

    def __init__(self, config: HarvestConfig, start_step: int = 0) -> None:
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"HarvestBuffer start_step must be an int >= 0, got {start_step!r}")
        self.config = config
        self._samples: deque[HarvestSample] = deque()
        self._current_step = start_step
        self._bytes = 0
        self._tokens = 0
        self._added = 0
        self._evicted = 0
        self._dropped = 0

    @property
    def current_step(self) -> int:
        return self._current_step

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def state(self) -> HarvestStats:
        return HarvestStats(
            bytes=self._bytes,
            samples=len(self._samples),
            tokens=self._tokens,
            current_step=self._current_step,
            added=self._added,
            evicted_for_space=self._evicted,
            dropped_stale=self._dropped,
        )

    def add(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        step: int,
        topk_values: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> HarvestSample:
        """Validate, copy to compact host storage, and append one sample (evicting the oldest if full)."""
        return self.add_sample(self.make_sample(token_ids, hidden, step, topk_values, topk_indices))

    def make_sample(self, token_ids: torch.Tensor, hidden: torch.Tensor, step: int,
                    topk_values: torch.Tensor | None = None,
                    topk_indices: torch.Tensor | None = None) -> HarvestSample:
        """`add`'s checks and compact host copy, without appending: a caller that collects a
        rollout's rows as they finish frees each row's features at once and appends them later."""
        self._check_step(step)
        return self._make_sample(token_ids, hidden, step, topk_values, topk_indices)

    def add_sample(self, sample: HarvestSample) -> HarvestSample:
        """Append a sample made by `make_sample` (evicting the oldest if full)."""
        self._check_step(sample.step)
        if sample.nbytes > self.config.max_bytes:
            raise ValueError(
                f"HarvestBuffer.add: one sample of {sample.length} tokens needs {sample.nbytes} bytes, more than "
                f"HarvestConfig.max_bytes={self.config.max_bytes}; raise max_bytes or truncate the sequence"
            )
        while self._bytes + sample.nbytes > self.config.max_bytes:
            self._remove_oldest()
            self._evicted += 1
        self._samples.append(sample)
        self._bytes += sample.nbytes
        self._tokens += sample.length
        self._added += 1
        return sample

    def advance_step(self, new_step: int | None = None) -> int:
        """Move to `new_step` (default: the next one) and drop samples `keep_steps` or more steps old."""
        target = self._current_step + 1 if new_step is None else new_step
        if not isinstance(target, int) or target < self._current_step:
            raise ValueError(
                f"HarvestBuffer.advance_step: new_step={new_step!r} must be an int >= current step {self._current_step}"
            )
        self._current_step = target
        oldest_kept = target - self.config.keep_steps + 1
        # Samples are appended in step order, so the stale ones sit at the left end.
        kept = deque(s for s in self._samples if s.step >= oldest_kept)
        dropped = len(self._samples) - len(kept)
        if dropped:
            self._samples = kept
            self._bytes = sum(s.nbytes for s in kept)
            self._tokens = sum(s.length for s in kept)
            self._dropped += dropped
        return dropped

    def clear(self) -> None:
        self._samples.clear()
        self._bytes = 0
        self._tokens = 0

    def samples(self) -> list[HarvestSample]:
        """All samples, oldest first (a shallow copy of the list; the tensors are shared)."""
        return list(self._samples)

    def sampling_weights(self) -> torch.Tensor:
        """Per-sample weights `recency_decay ** age`, in the order of `samples()` (float64)."""
        ages = torch.tensor([self._current_step - s.step for s in self._samples], dtype=torch.float64, device="cpu")
        return torch.pow(torch.tensor(float(self.config.recency_decay), dtype=torch.float64, device="cpu"), ages)

    def sample_batch(self, n: int, generator: torch.Generator) -> list[HarvestSample]:
        """Draw `n` samples with recency weights: without replacement while the buffer has
        at least `n` samples (no duplicates inside one batch), with replacement otherwise.
        The buffer is on the host, so `generator` is a CPU generator."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"HarvestBuffer.sample_batch: n must be a positive int, got {n!r}")
        if not self._samples:
            raise ValueError("HarvestBuffer.sample_batch: the buffer is empty; harvest rollouts first")
        weights = self.sampling_weights()
        replacement = n > len(self._samples)
        picks = torch.multinomial(weights, n, replacement=replacement, generator=generator)
        return [self._samples[i] for i in picks.tolist()]

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"HarvestBuffer.add: step must be an int, got {step!r}")
        oldest_kept = self._current_step - self.config.keep_steps + 1
        if step > self._current_step or step < oldest_kept:
            raise ValueError(
                f"HarvestBuffer.add: step={step} is outside the live window [{oldest_kept}, {self._current_step}]; "
                "call advance_step() when a new RL step begins"
            )

    def _make_sample(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        step: int,
        topk_values: torch.Tensor | None,
        topk_indices: torch.Tensor | None,
    ) -> HarvestSample:
        cfg = self.config
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError(f"HarvestBuffer.add: token_ids must be a 1-D tensor [L], got {_describe(token_ids)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"HarvestBuffer.add: token_ids must be an integer tensor, got dtype {token_ids.dtype}")
        length = int(token_ids.shape[0])
        if length < cfg.min_length:
            raise ValueError(
                f"HarvestBuffer.add: token_ids has {length} tokens, "
                f"fewer than HarvestConfig.min_length={cfg.min_length}"
            )
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.dtype.is_floating_point:
            raise ValueError(f"HarvestBuffer.add: hidden must be a floating 2-D tensor [L, H], got {_describe(hidden)}")
        if hidden.shape[1] != cfg.hidden_size:
            raise ValueError(
                f"HarvestBuffer.add: hidden has hidden size {hidden.shape[1]} but the drafter expects "
                f"HarvestConfig.hidden_size={cfg.hidden_size} (shape {tuple(hidden.shape)})"
            )
        if hidden.shape[0] not in (length - 1, length):
            raise ValueError(
                f"HarvestBuffer.add: hidden has {hidden.shape[0]} positions but token_ids has {length} tokens; "
                f"expected {length - 1} (one per predicted token) or {length}"
            )
        rows = hidden.shape[0]
        values, indices = self._check_topk(topk_values, topk_indices, rows)
        keep = length - 1  # the row at L-1 predicts a token beyond the sample: no training signal
        hidden = hidden[:keep]
        values = None if values is None else values[:keep]
        indices = None if indices is None else indices[:keep]
        return HarvestSample(
            token_ids=_host(token_ids, torch.int64),
            hidden=_host(hidden, cfg.storage_dtype),
            step=step,
            topk_values=None if values is None else _host(values, cfg.storage_dtype),
            topk_indices=None if indices is None else _host(indices, torch.int64),
        )

    def _check_topk(
        self, values: torch.Tensor | None, indices: torch.Tensor | None, length: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        k = self.config.topk
        if k == 0:
            if values is not None or indices is not None:
                raise ValueError("HarvestBuffer.add: top-k logits given but HarvestConfig.topk=0 stores none")
            return None, None
        if values is None or indices is None:
            raise ValueError(f"HarvestBuffer.add: HarvestConfig.topk={k} requires both topk_values and topk_indices")
        expected = (length, k)
        for name, tensor in (("topk_values", values), ("topk_indices", indices)):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                raise ValueError(f"HarvestBuffer.add: {name} must have shape {expected}, got {_describe(tensor)}")
        if not values.dtype.is_floating_point:
            raise ValueError(f"HarvestBuffer.add: topk_values must be floating, got dtype {values.dtype}")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise ValueError(f"HarvestBuffer.add: topk_indices must be an integer tensor, got dtype {indices.dtype}")
        return values, indices

    def _remove_oldest(self) -> None:
        sample = self._samples.popleft()
        self._bytes -= sample.nbytes
        self._tokens -= sample.length


def _host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A private host copy in the storage dtype (never a view of the caller's tensor)."""
    return tensor.detach().to(device="cpu", dtype=dtype, copy=True)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__}"
