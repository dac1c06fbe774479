"""Rank launches for the tests.

``launch_forked`` is ``launch_local`` with ``start_method="fork"``: the CPU gloo ranks
inherit the test process's imports (torch, megatron-core: see ``conftest.py``) instead of
importing them again. Four spawned ranks that import megatron-core start in about 10 s on a
2-core machine, four forked ones in about 0.1 s. Safe here because the test process never
touches CUDA (the launcher refuses a fork that would compute on CUDA) and hosts the launch's
store only after the fork (``nemo_tlt.dist.launch._host_store``). The spawn path itself is
tested in ``tests/dist/test_launch.py``, the SLURM and torchrun tests.
"""
from __future__ import annotations

from functools import partial

from nemo_tlt.dist import launch_local

launch_forked = partial(launch_local, start_method="fork")
