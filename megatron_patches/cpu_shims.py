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
  attention mask allocate on cuda explicitly.

The shims refuse to run where CUDA is available: on a GPU they would silently
move training to the CPU, which is never what anyone wants. CPU work on a GPU
host runs in processes that cannot see the GPU: ``gloo_launch.run_gloo`` starts
its children with ``CUDA_VISIBLE_DEVICES=""`` (what ``nemo-tlt convert`` and
``nemo-tlt bench reshard`` use).

Also here: ``seed_model_parallel`` (megatron's RNG tracker seeded without cuda),
``causal_attention_mask`` (the explicit mask megatron needs on CPU) and
``init_model_parallel`` (gloo process groups for a given TP/PP).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0] == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda`` keyword arguments and ``.cuda()`` / ``.to("cuda")``."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):  # type: ignore[override]
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


class CpuShims:
    """Handle for applied shims; ``remove()`` restores every patched attribute."""

    def __init__(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(
                "megatron_patches.cpu_shims must not be applied where CUDA is available: they would silently "
                "move megatron-core off the GPU. To run on the CPU on this host, hide the GPU from the process "
                "before it starts (CUDA_VISIBLE_DEVICES= ..., or megatron_patches.gloo_launch.run_gloo, whose "
                "children start that way); to use the GPU, run megatron-core without the shims (NCCL, torchrun)"
            )
        self._saved: dict[str, Any] = {
            "current_device": torch.cuda.current_device,
            "synchronize": torch.cuda.synchronize,
        }
        torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()
        self._active = True

    def remove(self) -> None:
        if not self._active:
            return
        self._mode.__exit__(None, None, None)
        torch.cuda.current_device = self._saved["current_device"]  # type: ignore[assignment]
        torch.cuda.synchronize = self._saved["synchronize"]  # type: ignore[assignment]
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


def init_model_parallel(tp: int, pp: int, *, seed: int = 1234) -> None:
    """Initialise megatron's parallel state on an already-initialised gloo world.

    ``torch.distributed.init_process_group("gloo", ...)`` must have been called by
    the launcher; world size must equal ``tp * pp`` times a data-parallel size.
    """
    from megatron.core import parallel_state

    if tp < 1 or pp < 1:
        raise ValueError(f"init_model_parallel: tp and pp must be >= 1, got tp={tp}, pp={pp}")
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"init_model_parallel: world size {world} is not divisible by tp*pp={tp * pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, order="tp-cp-ep-dp-pp"
    )
    seed_model_parallel(seed)


def seed_model_parallel(seed: int) -> None:
    """Seed megatron's RNG tracker on CPU (the inference tracker needs no cuda RNG)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def causal_attention_mask(seq_len: int, batch: int = 1) -> torch.Tensor:
    """Megatron's mask convention: ``True`` means *masked out*; shape ``[b, 1, s, s]``."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
    return mask.view(1, 1, seq_len, seq_len).expand(batch, 1, seq_len, seq_len)
