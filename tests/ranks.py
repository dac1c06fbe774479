"""Rank launches for the tests.

``launch_forked`` is ``launch_local`` with ``start_method="fork"`` on a host without CUDA:
the CPU gloo ranks inherit the test process's imports (torch, megatron-core: see
``conftest.py``) instead of importing them again. Four spawned ranks that import
megatron-core start in about 10 s on a 2-core machine, four forked ones in about 0.1 s.
Safe there: the launch hosts its store only after the fork
(``nemo_tlt.dist.launch._host_store``) and no thread of the test process holds a lock a
child needs (``conftest.py`` stops tqdm's monitor thread). Where torch sees CUDA the ranks
are spawned: a forked child keeps its parent's view of the GPUs, which
``CUDA_VISIBLE_DEVICES`` cannot hide from it. The spawn path itself is tested in
``tests/dist/test_launch.py``, the SLURM and torchrun tests and ``nemo-tlt convert``'s.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from nemo_tlt.dist import launch_local


def launch_forked(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    method = "spawn" if torch.cuda.is_available() else "fork"
    return launch_local(fn, world_size, *args, start_method=method, **kwargs)
