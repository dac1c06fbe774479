"""`launch` gives every worker `workers.threads_per_worker` torch threads, the single
in-process worker included, and gives the caller its own thread count back."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_tlt.rl.workers import launch


def test_single_worker_runs_with_threads_per_worker():
    before = torch.get_num_threads()
    want = before + 1
    spec = SimpleNamespace(config=SimpleNamespace(workers=SimpleNamespace(
        num_workers=1, threads_per_worker=want, timeout_s=60.0, start_method="spawn", launcher="local",
        device="cpu")))
    seen = launch(spec, lambda spec, comm, stop, on_step: {"threads": torch.get_num_threads(), "world": comm.world})
    assert seen == {"threads": want, "world": 1}
    assert torch.get_num_threads() == before
