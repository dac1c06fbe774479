"""Megatron's parallel state on an already-initialised process group, and where its tensors live.

Contract
--------
* ``init_model_parallel(tp, pp, seed=)`` initialises megatron's TP / PP / DP groups on the
  world the launcher created (``torch.distributed.init_process_group`` done: gloo on CPU,
  NCCL on GPU) and seeds megatron's RNG tracker. ``ensure_model_parallel`` does the same
  unless megatron's state already exists, which it then checks for the same TP / PP.
* ``compute_device()`` is the current CUDA device, or the CPU where there is none;
  ``device_context(device)`` applies ``megatron_patches.cpu_shims`` only on the CPU (on a
  GPU they would silently move training off it).
* ``default_backend()`` is the process-group backend megatron needs: NCCL on GPUs, gloo on CPU.
"""
from __future__ import annotations

import contextlib

import torch


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cpu":
        from megatron_patches.cpu_shims import cpu_shims

        return cpu_shims()
    return contextlib.nullcontext()


def init_model_parallel(tp: int, pp: int, *, seed: int = 1234) -> None:
    """Initialise megatron's parallel state; world size must be ``tp * pp`` times a data-parallel size."""
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


def ensure_model_parallel(tp: int, pp: int, *, seed: int, owner: str) -> None:
    """``init_model_parallel`` unless megatron's state exists; then it must be TP=tp, PP=pp."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_model_parallel(tp, pp, seed=seed)
        return
    have = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())
    if have != (tp, pp):
        raise ValueError(f"{owner} asks for TP={tp}, PP={pp} but megatron's parallel state is already "
                         f"initialised with TP={have[0]}, PP={have[1]}")


def seed_model_parallel(seed: int) -> None:
    """Seed megatron's RNG tracker (the inference tracker needs no cuda RNG, so this works on CPU)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
