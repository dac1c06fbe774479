"""``free_bytes``: what ``rollout.kv_cache_fraction`` takes a fraction of. On CUDA (simulated
here: the driver's and the caching allocator's counters stand in) it is the driver's free
memory plus what the allocator holds unused; on the CPU the host's available memory."""
from __future__ import annotations

import psutil
import pytest
import torch

from nemo_tlt.model.free_memory import free_bytes


def test_cuda_counts_the_driver_free_memory_and_the_allocators_unused_cache(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (asked.append(i), (7_000, 80_000))[1])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 5_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1_500)
    assert free_bytes("cuda:1") == 7_000 + 3_500 and free_bytes("cuda") == 10_500
    assert asked == [1, 3]  # the device asked for, else the current one


def test_cpu_is_the_hosts_available_memory():
    free = free_bytes(torch.device("cpu"))
    assert 0 < free <= psutil.virtual_memory().total


def test_other_devices_are_refused_by_name():
    with pytest.raises(ValueError, match=r"free_bytes: free memory is read on cuda or cpu devices, not on 'meta'"):
        free_bytes("meta")
