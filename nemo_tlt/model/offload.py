"""Tensors' device memory moved to host memory and back, in place (a policy's training state
during the rollout: ``rollout.training_state=offload``).

Contract
--------
``HostOffload(device)`` moves the storages of tensors on ``device``:

* ``offload(keep, drop=(), skip=())``: every distinct storage (views and tied tensors share
  one) of the ``keep`` tensors on ``device`` is copied to a host tensor (pinned where CUDA is
  available, so the copies back are DMA transfers; a plain CPU tensor otherwise); then it and
  the storages of ``drop`` (gradients: their values are dead between steps) are released in
  place with ``untyped_storage().resize_(0)``, megatron-core's own way of freeing a buffer
  (``_ParamAndGradBuffer.offload_to_cpu``). Storages of ``skip`` tensors (moved by someone
  else), of tensors on another device and empty ones are left alone. Returns the bytes copied.
  A storage that cannot be resized (memory shared with numpy or a memory map) is refused
  before anything moves.
* ``reload()``: every released storage gets its size back on ``device``; a kept one is
  refilled from its host copy (bit for bit), a dropped one is zeroed. Pinned host copies are
  kept for the next ``offload`` of storages of the same sizes (pinning host memory is far
  slower than copying into it: measured in docs/architecture.md); plain ones are freed.

Every tensor keeps its identity and its storage object, so whatever refers to it (an optimizer
state, a view, a hook, a kept reference) is valid again after ``reload``; reading one in
between is an error. On a CPU-only run the move is still real: the tensors' own storage is
released and a distinct host copy holds the values, so a test can see both.
"""
from __future__ import annotations

from typing import Iterable

import torch


def _storages(tensors: Iterable[torch.Tensor | None], device: torch.device, skip: set[int]
              ) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages on ``device`` (by address), none of ``skip``."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in skip:
            out.setdefault(key, storage)
    return out


def storage_keys(tensors: Iterable[torch.Tensor | None]) -> set[int]:
    """The addresses of the tensors' storages (what ``offload``'s ``skip`` compares)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


class HostOffload:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pin = torch.cuda.is_available()
        # (storage, its size in bytes, the host copy: None for a dropped storage)
        self._moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        self._pinned: list[torch.Tensor] = []  # the last offload's pinned host copies, in its order

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    @torch.no_grad()
    def offload(self, keep: Iterable[torch.Tensor | None], drop: Iterable[torch.Tensor | None] = (),
                skip: Iterable[torch.Tensor | None] = ()) -> int:
        if self._moved:
            raise RuntimeError("HostOffload.offload: already offloaded (reload first)")
        skipped = storage_keys(skip)
        kept = _storages(keep, self.device, skipped)
        dropped = {k: s for k, s in _storages(drop, self.device, skipped).items() if k not in kept}
        fixed = sum(not s.resizable() for s in (*kept.values(), *dropped.values()))
        if fixed:  # refused before anything moves
            raise RuntimeError(f"HostOffload.offload: {fixed} storage(s) of the training state cannot be released: "
                               "not resizable (memory shared with numpy, a memory map or another process)")
        copied, reuse = 0, self._pinned
        for i, storage in enumerate(kept.values()):
            host = (reuse[i] if i < len(reuse) and reuse[i].numel() == storage.nbytes() else
                    torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin))
            host.untyped_storage().copy_(storage, non_blocking=self.pin)
            self._moved.append((storage, storage.nbytes(), host))
            copied += storage.nbytes()
        self._moved += [(s, s.nbytes(), None) for s in dropped.values()]
        self._synchronize()  # the host copies are complete before their device memory is given up
        for storage, _, _ in self._moved:
            storage.resize_(0)
        return copied

    @torch.no_grad()
    def reload(self) -> None:
        for storage, nbytes, host in self._moved:
            storage.resize_(nbytes)
            if host is None:
                storage.fill_(0)
            else:
                storage.copy_(host.untyped_storage(), non_blocking=self.pin)
        self._synchronize()  # the values are in place when the caller's clock stops
        self._pinned = [host for _, _, host in self._moved if host is not None] if self.pin else []
        self._moved = []

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
