"""Where a rank computes: its device and the weights dtype, from configuration.

Contract
--------
* ``DEVICES`` (``auto`` | ``cpu`` | ``cuda``) and ``DTYPES`` (``float32`` | ``bfloat16``)
  are the values ``workers.device`` and ``model.dtype`` take.
* ``resolve_device(kind, local_rank, cuda_available=None, device_count=None)``: the
  ``torch.device`` rank ``local_rank`` of its node computes on. ``cuda`` binds
  ``cuda:LOCAL_RANK`` (one GPU per rank; every GPU of the node stays visible so NCCL can
  use NVLink peer-to-peer); ``auto`` is ``cuda`` when CUDA is available, else ``cpu``.
  ``cuda`` without CUDA, or a local rank past the node's GPU count, raises ``ValueError``
  naming ``workers.device`` and what was found.
* ``torch_dtype(name)``: the ``torch.dtype`` of a ``DTYPES`` name.
* ``Placement(device, dtype)``: what a component is built with; nothing it creates lives
  elsewhere (tensors cross to the host only where a value must leave the device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(kind: str, local_rank: int = 0, cuda_available: bool | None = None,
                   device_count: int | None = None) -> torch.device:
    """The device of the rank with this node-local index (see the module docstring)."""
    if kind not in DEVICES:
        raise ValueError(f"workers.device must be one of {list(DEVICES)}, got {kind!r}")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if kind == "cpu" or (kind == "auto" and not available):
        return torch.device("cpu")
    if not available:
        raise ValueError("workers.device=cuda, but CUDA is not available here (torch.cuda.is_available() is "
                         "False: a CPU build of torch, no GPU, or CUDA_VISIBLE_DEVICES hides them); use "
                         "workers.device=cpu or auto")
    count = torch.cuda.device_count() if device_count is None else device_count
    if not 0 <= local_rank < count:
        raise ValueError(f"workers.device=cuda: local rank {local_rank} has no GPU of its own (this node shows "
                         f"{count} GPU(s)); start at most {count} ranks per node, one GPU each")
    return torch.device("cuda", local_rank)


@dataclass(frozen=True)
class Placement:
    """The device and weights dtype a rank's components are built with."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    @classmethod
    def cpu(cls, dtype: torch.dtype = torch.float32) -> "Placement":
        return cls(torch.device("cpu"), dtype)


def cuda_uuid(index: int) -> str:
    """CUDA device ``index``'s UUID in NVML's form, "GPU-" + the device properties' ``uuid``
    (how TensorRT-LLM's ``get_device_uuid`` and NeMo-RL's workers name a GPU)."""
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid)


def cuda_device_of_uuid(uuid: str, what: str) -> torch.device:
    """The CUDA device of this process whose UUID is ``uuid`` in NVML's form ("GPU-" + the
    device properties' ``uuid``: how TensorRT-LLM's ``get_device_uuid`` and NeMo-RL's workers
    name a GPU); a ValueError naming ``what`` and the UUID when this process does not see it."""
    seen = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        seen.append(cuda_uuid(i))
        if seen[-1] == uuid:
            return torch.device("cuda", i)
    raise ValueError(f"{what}: GPU {uuid} is not one of this process's CUDA devices ({seen or 'none'}); CUDA IPC "
                     "handles can only be made and opened on a visible GPU")
