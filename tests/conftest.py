"""Shared fixtures: tiny in-process models (2 layers, hidden 32), the tiny RL assets built
once per session (``tiny_models``), megatron-core imported once for the forked ranks."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny import tiny_config, tiny_target  # noqa: E402


# What forked ranks and forked RL workers (tests/ranks.py, workers.start_method=fork) use
# of megatron-core, imported once here so that each of them inherits it instead of importing
# it again (about 3 s of CPU per rank on the 2-core machine).
MEGATRON_MODULES = ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
                    "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel")


@pytest.fixture(scope="session", autouse=True)
def _megatron_imported_once():
    """Where ranks are forked (no CUDA: tests/ranks.py); a missing or broken megatron-core is
    left to the tests that import it (they skip or fail by name)."""
    import importlib
    import warnings

    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            try:
                for name in MEGATRON_MODULES:
                    importlib.import_module(name)
            except ImportError:
                pass
    yield


# tqdm starts a monitor thread at its first bar (even a disabled one) that takes tqdm's lock
# every 10 s; a rank forked while it holds it would deadlock on its own first bar.
import tqdm  # noqa: E402

tqdm.tqdm.monitor_interval = 0


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(target, drafter) folders of the tiny RL assets (``tiny_rl.py``): built once per session
    and shared by every loop, resume, SLURM and torchrun test; none of them writes into them."""
    from tiny_rl import tiny_assets

    return tiny_assets(tmp_path_factory.getbasetemp() / "tlt_tiny_assets")


@pytest.fixture
def tiny_cfg():
    return tiny_config()


@pytest.fixture
def target():
    return tiny_target()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that run vLLM (``vllm`` mark) go last, in their order. vLLM's in-process
    engine leaves its state in the pytest process (a default torch.distributed process group,
    OpenMP threads bound to cores), which ranks forked afterwards would inherit: they could
    not start their own process group."""
    items[:] = [i for i in items if i.get_closest_marker("vllm") is None] + \
               [i for i in items if i.get_closest_marker("vllm") is not None]
