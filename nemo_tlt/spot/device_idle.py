"""Optional confirmation of idleness from the device: NVML's GPU utilisation.

Contract
--------
* ``device_utilization(local_index, env=None) -> float | None``: the utilisation of this
  process's CUDA device ``local_index`` (its CUDA ordinal) as a fraction in [0, 1], as
  NVML last sampled it. ``None``, never an exception, when ``pynvml`` (package
  ``nvidia-ml-py``) is not installed, NVML cannot start (no NVIDIA driver: a CPU host),
  or there is no such device. ``pynvml`` is imported on the first call only.
* ``nvml_device(local_index, visible)``: the NVML device a CUDA ordinal names, through
  ``CUDA_VISIBLE_DEVICES`` (``visible``): its ``local_index``-th entry, an NVML index
  (int) or a ``GPU-``/``MIG-`` UUID (str); ``local_index`` itself when it is unset;
  None when the ordinal is beyond the visible devices.
* ``current_device_utilization()``: the reading for ``torch.cuda.current_device()``, or
  None without CUDA (NVML is then not touched).

The reading is a confirmation recorded beside the RL loop's own idle signal (a rank
whose rollout share is done); it never decides a state by itself: NVML's utilisation is
a fraction of a past sampling window, shared by every process on the device.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import Mapping

import torch

log = logging.getLogger(__name__)


def nvml_device(local_index: int, visible: str | None) -> int | str | None:
    if isinstance(local_index, bool) or not isinstance(local_index, int) or local_index < 0:
        raise ValueError(f"nvml_device: local_index must be an int >= 0, got {local_index!r}")
    if visible is None:
        return local_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if local_index >= len(entries):
        return None
    entry = entries[local_index]
    return int(entry) if entry.isdigit() else entry


def device_utilization(local_index: int, env: Mapping[str, str] | None = None) -> float | None:
    env = os.environ if env is None else env
    device = nvml_device(local_index, env.get("CUDA_VISIBLE_DEVICES"))
    if device is None:
        return None
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:  # no driver / library: a CPU host is not an error
        log.debug("NVML unavailable: %s", err)
        return None
    try:
        if isinstance(device, int):
            if device >= nvml.nvmlDeviceGetCount():
                return None
            handle = nvml.nvmlDeviceGetHandleByIndex(device)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(device)
        return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0
    except nvml.NVMLError as err:  # unknown UUID, or a device (MIG slice) that reports no utilisation
        log.debug("NVML has no utilisation for device %r: %s", device, err)
        return None
    finally:
        nvml.nvmlShutdown()


def current_device_utilization() -> float | None:
    if not torch.cuda.is_available():
        return None
    return device_utilization(torch.cuda.current_device())
