"""CPU shims that let real megatron-core run on CPU with the gloo backend.

Contract: nothing here is applied on import. ``cpu_shims()`` is a context
manager (``apply_cpu_shims()`` / ``CpuShims.remove()`` the explicit form) that
patches, for its lifetime only:

* ``torch.cuda.current_device`` -> returns the CPU device, because megatron-core
  asks for it when it places freshly initialised weights and RNG states;
* ``torch.cuda.synchronize`` -> no-op, because ``dist_checkpointing`` calls it
  around saves;
* tensor creations with ``device="cuda"`` (or ``cuda:N``) -> redirected to CPU
  by a ``TorchFunctionMode``, because the pipeline schedules and the default
  attention mask allocate on cuda explicitly;
* ``Tensor.type()`` (no argument) of a float32 / float16 / bfloat16 tensor -> its
  ``torch.cuda.*Tensor`` name, by the same mode, because megatron-core's mixed-precision
  and distributed optimizers dispatch on that string (``distrib_optimizer.py``
  ``_build_model_and_main_param_groups`` raises TypeError for ``torch.FloatTensor``);
* megatron-core's ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
  -> the CPU generator's state / a no-op, because activation recompute
  (``tensor_parallel.checkpoint``: ``recompute_granularity`` full and selective) saves the
  CUDA RNG state before the forward and restores it around the recomputed one. On CPU every
  random draw comes from the CPU generator, which megatron saves and restores beside it
  (``_get_all_rng_states``), so the recomputed forward sees the same randomness.

The shims refuse to run where CUDA is available: on a GPU they would silently
move training to the CPU, which is never what anyone wants. CPU work on a GPU
host runs in processes that cannot see the GPU: ``nemo_tlt.dist.launch_local``
starts its children with ``CUDA_VISIBLE_DEVICES=""`` (what ``nemo-tlt convert`` and
``nemo-tlt bench reshard`` use).

Imports torch, and megatron-core's ``tensor_parallel.random`` (the module it patches) where
megatron-core is installed; nothing of nemo_tlt.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import contextlib
import importlib
import importlib.util

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0] == "cuda"
    return False


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda`` keyword arguments and ``.cuda()`` / ``.to("cuda")``; ``Tensor.type()``
    names the cuda type."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):  # type: ignore[override]
        if (getattr(func, "__name__", "") == "type" and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and args[0].dtype in _CUDA_TYPE_NAMES):
            return _CUDA_TYPE_NAMES[args[0].dtype]
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        name = getattr(func, "__name__", "")
        if name == "cuda":
            # Tensor.cuda(...) on CPU: the tensor already lives where it should.
            return args[0]
        if name == "to":
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


_MEGATRON_RNG = "megatron.core.tensor_parallel.random"


def _megatron_rng_module() -> Any | None:
    """megatron-core's RNG module (None where megatron-core is not installed)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return None
    return importlib.import_module(_MEGATRON_RNG)


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


class CpuShims:
    """Handle for applied shims; ``remove()`` restores every patched attribute."""

    def __init__(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(
                "megatron_patches.cpu_shims must not be applied where CUDA is available: they would silently "
                "move megatron-core off the GPU. To run on the CPU on this host, hide the GPU from the process "
                "before it starts (CUDA_VISIBLE_DEVICES= ..., or nemo_tlt.dist.launch_local, whose "
                "children start that way); to use the GPU, run megatron-core without the shims (NCCL, torchrun)"
            )
        self._saved: dict[str, Any] = {
            "current_device": torch.cuda.current_device,
            "synchronize": torch.cuda.synchronize,
        }
        torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        self._rng = _megatron_rng_module()
        if self._rng is not None:
            self._saved.update(get_rng=self._rng._get_cuda_rng_state, set_rng=self._rng._set_cuda_rng_state)
            self._rng._get_cuda_rng_state = _cpu_rng_state
            self._rng._set_cuda_rng_state = _no_cuda_rng_state
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()
        self._active = True

    def remove(self) -> None:
        if not self._active:
            return
        self._mode.__exit__(None, None, None)
        torch.cuda.current_device = self._saved["current_device"]  # type: ignore[assignment]
        torch.cuda.synchronize = self._saved["synchronize"]  # type: ignore[assignment]
        if self._rng is not None:
            self._rng._get_cuda_rng_state = self._saved["get_rng"]
            self._rng._set_cuda_rng_state = self._saved["set_rng"]
        self._active = False


def apply_cpu_shims() -> CpuShims:
    """Apply the shims now; call ``.remove()`` on the result to undo them."""
    return CpuShims()


@contextlib.contextmanager
def cpu_shims() -> Iterator[CpuShims]:
    shims = apply_cpu_shims()
    try:
        yield shims
    finally:
        shims.remove()
