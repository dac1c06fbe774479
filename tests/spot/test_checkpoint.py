"""Tests for nemo_tlt.spot.checkpoint: exact round trip, atomicity under kill -9,
keep-last-K, validation and refusal, and that async saves return before the write."""
from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nemo_tlt.spot.checkpoint import CheckpointManager

pytestmark = pytest.mark.timeout(60)


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_exact_round_trip_and_resume(tmp_path):
    model, opt = _model_and_optimizer()
    _train(model, opt, 3, seed=1)
    extra_tensors = {"bf16": torch.randn(3, 2).to(torch.bfloat16), "ids": torch.arange(7)}
    bandit = {"arms": ["8_4_32", "6_2_16"], "counts": [3, 4], "values": [1.5, 0.25], "step": 17}
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save_async(17, {**model.state_dict(), **extra_tensors}, {"optimizer": opt.state_dict()}, {"bandit": bandit})
        mgr.wait()
        ckpt = mgr.load()
    assert ckpt.step == 17 and ckpt.json_state == {"bandit": bandit}
    for name, tensor in {**model.state_dict(), **extra_tensors}.items():
        assert ckpt.tensors[name].dtype == tensor.dtype and torch.equal(ckpt.tensors[name], tensor), name
    # Exact resume: a fresh model + optimizer restored from the checkpoint continues bit-identically.
    model2, opt2 = _model_and_optimizer(seed=5)
    model2.load_state_dict({k: v for k, v in ckpt.tensors.items() if k not in extra_tensors})
    opt2.load_state_dict(ckpt.extra_state["optimizer"])
    _train(model, opt, 2, seed=9)
    _train(model2, opt2, 2, seed=9)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def test_snapshot_is_isolated_from_later_updates(tmp_path):
    model, opt = _model_and_optimizer()
    _train(model, opt, 1, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg_before = opt.state_dict()["state"][0]["exp_avg"].clone()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save_async(1, model.state_dict(), {"optimizer": opt.state_dict()})
        _train(model, opt, 3, seed=2)  # in-place updates while the write may be in flight
        mgr.wait()
        ckpt = mgr.load(1)
    for name, tensor in before.items():
        assert torch.equal(ckpt.tensors[name], tensor)
    assert torch.equal(ckpt.extra_state["optimizer"]["state"][0]["exp_avg"], exp_avg_before)


def test_keep_last_k_and_stale_temp_cleanup(tmp_path):
    (tmp_path / ".tmp-step-00000000").mkdir()  # a killed writer's leftover (older naming)
    (tmp_path / ".step-00000001.partial-k1ll3d").mkdir()  # ... and atomic_output_dir's
    with CheckpointManager(tmp_path, keep_last=2, fsync=False) as mgr:
        for step in range(5):
            mgr.save_async(step, {"w": torch.full((2,), float(step))}, json_state={"step": step})
        mgr.wait()
        assert mgr.steps() == [3, 4] and mgr.latest() == 4
        assert float(mgr.load().tensors["w"][0]) == 4.0
        mgr.save_sync(4, {"w": torch.full((2,), 40.0)})  # re-saving a step replaces it
        assert float(mgr.load(4).tensors["w"][0]) == 40.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


def test_mismatched_shapes_are_refused_naming_tensor_and_shapes(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save_sync(3, {"fc.weight": torch.zeros(8, 16), "fc.bias": torch.zeros(8)})
        ok = mgr.load(expected_shapes={"fc.weight": (8, 16), "fc.bias": torch.Size([8])})
        assert ok.step == 3
        with pytest.raises(ValueError, match=r"'fc.weight' has shape \(8, 16\) but the target expects \(8, 32\)"):
            mgr.load(expected_shapes={"fc.weight": (8, 32), "fc.bias": (8,)})
        with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\].*unexpected \['fc.bias'\]"):
            mgr.load(expected_shapes={"fc.weight": (8, 16), "lm_head.weight": (4, 4)})


def test_incomplete_checkpoints_are_skipped_or_refused(tmp_path):
    with CheckpointManager(tmp_path, keep_last=5) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save_sync(step, {"w": torch.arange(1000.0) + step}, {"opt": torch.ones(3)}, {"s": step})
    os.remove(tmp_path / "step-00000004" / "manifest.json")
    weights3 = tmp_path / "step-00000003" / "weights.safetensors"
    with open(weights3, "r+b") as handle:
        handle.truncate(weights3.stat().st_size - 100)
    extra2 = tmp_path / "step-00000002" / "extra_state.pt"
    data = bytearray(extra2.read_bytes())
    data[-30] ^= 0xFF  # same size, flipped bits: only the checksum catches it
    extra2.write_bytes(bytes(data))
    mgr = CheckpointManager(tmp_path, keep_last=5)
    assert mgr.steps() == [1, 2]  # size checks only for listing
    with pytest.raises(ValueError, match="has no manifest.json"):
        mgr.load(4)
    with pytest.raises(ValueError, match="partial write"):
        mgr.load(3)
    with pytest.raises(ValueError, match="SHA-256"):
        mgr.load(2)
    assert mgr.load(1).json_state == {"s": 1}
    with pytest.raises(FileNotFoundError):
        mgr.load(9)
    mgr.close()


def test_bad_state_is_refused_on_the_caller_or_reraised(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="JSON round trip"):
            mgr.save_async(1, {}, json_state={"pair": (1, 2)})
        with pytest.raises(ValueError, match="not JSON-serializable"):
            mgr.save_async(1, {}, json_state={"t": torch.ones(1)})
        mgr.save_async(1, {"w": torch.ones(1)}, extra_state={"f": lambda: 0})  # unpicklable: fails in background
        with pytest.raises(Exception, match="pickle"):
            mgr.wait()
        assert mgr.latest() is None
        mgr.save_sync(2, {"w": torch.ones(1)})
        assert mgr.latest() == 2


_GATES: dict[str, threading.Event] = {}


class _GatedPickle:
    """Pickling blocks until the test opens its gate: holds the background write open."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def __deepcopy__(self, memo: dict) -> "_GatedPickle":
        return self  # the snapshot copies on the caller's thread; only the write blocks

    def __reduce__(self):
        _GATES[self.gate].wait(timeout=30)
        return (collections.OrderedDict, ())  # reads back as an empty dict under weights_only


def test_async_save_returns_before_the_write_completes(tmp_path):
    _GATES["async"] = threading.Event()
    mgr = CheckpointManager(tmp_path)
    try:
        future = mgr.save_async(1, {"w": torch.randn(256, 256)}, {"slow": _GatedPickle("async")})
        # returned while the write is in flight (a write on the caller's thread would have waited
        # for the gate, released only below, and be done)
        assert not future.done() and mgr.latest() is None
    finally:
        _GATES["async"].set()
    mgr.wait()
    assert future.done() and mgr.latest() == 1 and mgr.load().extra_state == {"slow": {}}
    mgr.close()


class _KillMePickle:
    """Signals the parent that the writer is mid-write, then stalls until killed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __deepcopy__(self, memo: dict) -> "_KillMePickle":
        return self

    def __reduce__(self):
        Path(self.marker).write_text("mid-write")
        time.sleep(60)
        return (int, (0,))


def _writer(directory: str, marker: str) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    mgr = CheckpointManager(directory, keep_last=3)
    mgr.save_sync(1, {"w": torch.arange(12.0).view(3, 4)}, {"opt": {"lr": 0.5}}, {"step": 1})
    big = {"w": torch.zeros(3, 4), "big": torch.ones(4 * 1024 * 1024)}  # 16 MiB already written when killed
    mgr.save_async(2, big, {"slow": _KillMePickle(marker)}, {"step": 2})
    mgr.wait()


def test_kill_minus_9_during_write_leaves_previous_checkpoint_loadable(tmp_path):
    marker = tmp_path / "marker"
    ckpt_dir = tmp_path / "ckpt"
    proc = mp.get_context("fork").Process(target=_writer, args=(str(ckpt_dir), str(marker)))
    proc.start()
    try:
        deadline = time.monotonic() + 40
        while not marker.exists():
            assert proc.is_alive() and time.monotonic() < deadline, "writer died before reaching the write"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    [tmp] = ckpt_dir.glob(".step-00000002.partial-*")  # the dead writer's hidden partial folder
    assert (tmp / "weights.safetensors").exists() and not (ckpt_dir / "step-00000002").exists()
    with CheckpointManager(ckpt_dir) as mgr:
        assert mgr.latest() == 1
        ckpt = mgr.load()
        assert torch.equal(ckpt.tensors["w"], torch.arange(12.0).view(3, 4))
        assert ckpt.extra_state == {"opt": {"lr": 0.5}} and ckpt.json_state == {"step": 1}
        mgr.save_sync(3, {"w": torch.zeros(1)})  # the next write clears the dead writer's folder
    assert not tmp.exists()
    assert json.loads((ckpt_dir / "step-00000003" / "manifest.json").read_text())["step"] == 3
