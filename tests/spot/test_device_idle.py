"""NVML confirmation of idleness: None, never an error, without pynvml, without a driver or
without the device; CUDA ordinals map through CUDA_VISIBLE_DEVICES to NVML devices (a
stand-in pynvml module here); the real NVML reading runs only on a CUDA host."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from nemo_tlt.spot.device_idle import current_device_utilization, device_utilization, nvml_device


class _NVMLError(Exception):
    pass


def fake_pynvml(init_error: bool = False, utilization: dict | None = None) -> types.ModuleType:
    """A stand-in for pynvml's surface: devices by NVML index or UUID, with their utilisation (%)."""
    utilization = {} if utilization is None else utilization
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _NVMLError
    nvml.calls = []

    def init():
        nvml.calls.append("init")
        if init_error:
            raise _NVMLError("NVML Shared Library Not Found")

    def by_uuid(uuid):
        if uuid not in utilization:
            raise _NVMLError("Not Found")
        return uuid

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: sum(isinstance(k, int) for k in utilization)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=utilization[handle], memory=0)
    return nvml


def test_without_pynvml_there_is_no_reading_and_no_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what an absent package looks like to import
    assert device_utilization(0, env={}) is None


def test_without_a_driver_there_is_no_reading_and_no_error(monkeypatch):
    nvml = fake_pynvml(init_error=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_utilization(0, env={}) is None
    assert nvml.calls == ["init"]


def test_readings_by_index_and_uuid_and_missing_devices(monkeypatch):
    nvml = fake_pynvml(utilization={0: 12, 1: 0, 2: 37, 3: 100, "GPU-abc": 55})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_utilization(2, env={}) == pytest.approx(0.37)
    assert device_utilization(0, env={"CUDA_VISIBLE_DEVICES": "3,1"}) == pytest.approx(1.0)
    assert device_utilization(1, env={"CUDA_VISIBLE_DEVICES": "3,1"}) == 0.0
    assert device_utilization(0, env={"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == pytest.approx(0.55)
    assert device_utilization(0, env={"CUDA_VISIBLE_DEVICES": "GPU-zzz"}) is None  # unknown UUID
    assert device_utilization(4, env={}) is None  # beyond NVML's devices
    assert device_utilization(2, env={"CUDA_VISIBLE_DEVICES": "0,1"}) is None  # beyond the visible ones
    assert device_utilization(0, env={"CUDA_VISIBLE_DEVICES": ""}) is None
    # NVML is shut down after every reading it started
    assert nvml.calls.count("init") == nvml.calls.count("shutdown") == 6


def test_cuda_ordinals_name_nvml_devices():
    assert nvml_device(1, None) == 1
    assert nvml_device(1, "4, 6") == 6 and nvml_device(0, "GPU-1f2e") == "GPU-1f2e"
    assert nvml_device(2, "4,6") is None and nvml_device(0, "") is None
    with pytest.raises(ValueError, match="local_index"):
        nvml_device(-1, None)


def test_without_cuda_nvml_is_not_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(utilization={0: 50}))
    assert current_device_utilization() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_device_reports_a_fraction():
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py")
    value = current_device_utilization()
    assert value is not None and 0.0 <= value <= 1.0
