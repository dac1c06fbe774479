"""The conformance suite's fixtures: engine factories and tiny HF-format model folders.

Every test takes `make_engine`, a factory ``(model_dir: Path) -> RolloutEngine`` that
serves the HF-format folder `model_dir`; it is parametrized over `ENGINES`, so a
second engine is one more entry there (see README.md). The reference the engines
are held to is the plain PyTorch `DecoderLM` read from the same folder.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import pytest
import torch

from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.protocol import RolloutEngine
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from tiny import tiny_target

EngineFactory = Callable[[Path], RolloutEngine]


def torch_engine(model_dir: Path) -> RolloutEngine:
    return TorchRolloutEngine.from_hf_folder(model_dir)


def trtllm_engine(model_dir: Path) -> RolloutEngine:
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine  # lazy: optional package
    return TRTLLMRolloutEngine.from_hf_folder(model_dir)


def needs(package: str, cuda: bool = False) -> list[pytest.MarkDecorator]:
    """Marks for an engine that needs `package` (and a CUDA device): skipped with the
    reason where it is missing. See README.md."""
    missing = importlib.util.find_spec(package) is None
    marks = [pytest.mark.skipif(missing, reason=f"needs the {package} package")]
    if cuda:
        marks += [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
    return marks


# One entry per engine (see README.md). The trtllm cases run only with TensorRT-LLM and a
# CUDA device (`pytest -m trtllm` on a GPU node; docs/trtllm.md); they were never run here.
ENGINES = [pytest.param(torch_engine, id="torch"),
           pytest.param(trtllm_engine, id="trtllm", marks=[pytest.mark.trtllm, *needs("tensorrt_llm", cuda=True)])]


@pytest.fixture(scope="session", params=ENGINES)
def make_engine(request) -> EngineFactory:
    return request.param


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama-family target with sharpened distributions (long greedy runs
    a drafter can follow; EOS is sampled now and then)."""
    return save_hf_folder(tiny_target(seed=3, scale=5.0), tmp_path_factory.mktemp("conformance") / "target")


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """The same architecture as `model_dir` with other weights."""
    return save_hf_folder(tiny_target(seed=11, scale=5.0), tmp_path_factory.mktemp("conformance") / "other")


@pytest.fixture(scope="session")
def reference(model_dir) -> DecoderLM:
    """The oracle: the plain PyTorch model read from the same folder."""
    return load_hf_folder(model_dir).eval()
