"""Shared fixtures: tiny in-process models (2 layers, hidden 32)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny import tiny_config, tiny_target  # noqa: E402


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
