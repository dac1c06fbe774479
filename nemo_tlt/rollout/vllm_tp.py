"""vLLM's tensor-parallel workers in the caller's ranks (``VLLMEngineConfig.external_launcher``).

Each of the ranks of an initialized ``torch.distributed`` world builds the engine, and vLLM's
``external_launcher`` executor makes its in-process worker one TP worker of a group of
``tensor_parallel_size`` consecutive ranks (``distributed/parallel_state.py``,
``initialize_model_parallel``). What the engine needs around vLLM's build for that:
`check_world` (refused before vLLM is touched), `building_workers` (the environment vLLM's
executor reads, and per-run names for the CPU build's shared memory) and `tp_group` (the group
the members' lockstep uses, vLLM's own); `build_environ` sets variables for any vLLM build.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.rollout.vllm_config import VLLMEngineConfig, vllm_cpu_build


def check_world(config: VLLMEngineConfig) -> None:
    """A ValueError unless ``torch.distributed`` is initialized over a world that vLLM can cut
    into TP groups of ``config.tensor_parallel_size`` (nothing to check without ``external_launcher``)."""
    if not config.external_launcher:
        return
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
    if world == 0 or world % config.tensor_parallel_size:
        now = f"its world is {world}" if world else "it is not initialized"
        raise ValueError(f"VLLMEngineConfig.external_launcher: torch.distributed must be initialized over a world "
                         f"of a multiple of tensor_parallel_size={config.tensor_parallel_size} ranks (vLLM groups "
                         f"consecutive ranks); {now}")


@contextlib.contextmanager
def building_workers(config: VLLMEngineConfig) -> Iterator[None]:
    """Around ``vllm.LLM(...)``: `_launcher_env` and `_run_unique_shm` (nothing without
    ``external_launcher``)."""
    with _launcher_env(config), _run_unique_shm(config):
        yield


def tp_group() -> TensorParallel:
    """This process's place in vLLM's tensor-parallel group (its CPU group: small collectives)."""
    state = importlib.import_module("vllm.distributed.parallel_state")
    return TensorParallel.of_group(state.get_tp_group().cpu_group)


@contextlib.contextmanager
def build_environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` while vLLM is built, then these keys restored (or removed)
    and no others: variables vLLM sets for itself meanwhile stay (``mock.patch.dict`` would
    restore the whole environment)."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _launcher_env(config: VLLMEngineConfig) -> Iterator[None]:
    """``RANK`` and ``LOCAL_RANK`` as vLLM's ``external_launcher`` executor reads them while the
    engine is built (``ExecutorWithExternalLauncher._distributed_args``): the global rank, and
    ``config.local_rank``, else the ``LOCAL_RANK`` already set, else the rank. Restored after."""
    if not config.external_launcher:
        yield
        return
    import torch.distributed as dist
    rank = dist.get_rank()
    local = config.local_rank if config.local_rank is not None else int(os.environ.get("LOCAL_RANK", rank))
    with build_environ({"RANK": str(rank), "LOCAL_RANK": str(local)}):
        yield


@contextlib.contextmanager
def _run_unique_shm(config: VLLMEngineConfig) -> Iterator[None]:
    """On vLLM's CPU build under ``external_launcher``: the TP group's shared-memory segments
    named per run. vLLM names them from ``VLLM_DIST_IDENT``, which its CPU worker derives from
    the init method's port, and ``external_launcher``'s init method is ``env://`` (no port): every
    run would use the same names, two runs on a host would collide, and a run killed before its
    shutdown (which unlinks them) would leave segments that make every later run fail
    (``create shm in SHMManager failed. errno: 17``). The names get a suffix from global rank 0's
    pid and a random number, broadcast (collective: every rank builds its engine here)."""
    if not (config.external_launcher and vllm_cpu_build()):
        yield
        return
    import secrets

    import torch.distributed as dist
    nonce = [f"tlt{os.getpid()}x{secrets.token_hex(4)}"]
    dist.broadcast_object_list(nonce, src=0)
    module = importlib.import_module("vllm.distributed.device_communicators.cpu_communicator")
    shm = module._CPUSHMDistributed
    original = shm.__dict__["make_group_name"]
    shm.make_group_name = staticmethod(lambda communicator: f"{original.__func__(communicator)}-{nonce[0]}")
    try:
        yield
    finally:
        shm.make_group_name = original
