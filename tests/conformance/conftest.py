"""The conformance suite's fixtures: the engines under test and tiny HF-format model folders.

Every test takes `make_engine`, an `EngineUnderTest` (engines.py): ``make_engine(model_dir)``
serves the HF-format folder `model_dir`, ``make_engine.drafter(kind, cfg)`` is the
suite's drafter in the form that engine loads, ``make_engine.require(...)`` skips what
the engine declares it cannot do. It is parametrized over `ENGINES`, so a second engine
is one more entry there (see README.md). The reference the engines are held to is the
plain PyTorch `DecoderLM` read from the same folder.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from engines import TORCH, TRTLLM, TRTLLM_LIMITS, VLLM, VLLM_ENGINES, EngineUnderTest
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.selfcheck.trtllm_check import DrafterNotCached, TrainedEagle3, export_trained_eagle3
from tiny import tiny_target


def needs(package: str, cuda: bool = False, installed_in_ci: bool = False) -> list[pytest.MarkDecorator]:
    """Marks for an engine that needs `package` (and a CUDA device): skipped with the
    reason where it is missing, except under CI (``CI=true``) for a package the README's
    test command installs (``installed_in_ci``): there its cases run and fail. See README.md."""
    missing = importlib.util.find_spec(package) is None and not (installed_in_ci and os.environ.get("CI") == "true")
    marks = [pytest.mark.skipif(missing, reason=f"needs the {package} package")]
    if cuda:
        marks += [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
    return marks


# One entry per engine (see README.md). The trtllm cases run only with TensorRT-LLM and a
# CUDA device (`pytest -m trtllm` on a GPU node; docs/trtllm.md); they were never run here.
# torch-as-trtllm runs the suite's trtllm path (exported drafters, declared limits) on the
# torch engine, so a trtllm failure on a GPU node points at the TensorRT-LLM engine.
ENGINES = [pytest.param(TORCH, id="torch"),
           pytest.param(TRTLLM_LIMITS, id="torch-as-trtllm"),
           pytest.param(TRTLLM, id="trtllm", marks=[pytest.mark.trtllm, *needs("tensorrt_llm", cuda=True)]),
           pytest.param(VLLM, id="vllm", marks=[pytest.mark.vllm, *needs("vllm", installed_in_ci=True)])]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before the test's fixtures: the vLLM engine cache counts the engines a test asks for
    from here (engines.py `_VLLMEngines`), so that two asked for in one test are distinct."""
    VLLM_ENGINES.new_test()


@pytest.fixture(scope="session", params=ENGINES)
def make_engine(request, tmp_path_factory) -> EngineUnderTest:
    return EngineUnderTest(request.param, tmp_path_factory.mktemp(f"drafters-{request.param.name}"))


@pytest.fixture(scope="session")
def model_dir(make_engine, tmp_path_factory) -> Path:
    """A tiny Llama-family target (tests/tiny.tiny_config: 2 layers, unless the engine's
    model_shape says otherwise) with sharpened distributions (long greedy runs a drafter
    can follow; EOS is sampled now and then)."""
    model = tiny_target(seed=3, scale=5.0, **make_engine.spec.model_shape)
    return save_hf_folder(model, tmp_path_factory.mktemp("conformance") / "target")


@pytest.fixture(scope="session")
def other_model_dir(make_engine, tmp_path_factory) -> Path:
    """The same architecture as `model_dir` with other weights."""
    model = tiny_target(seed=11, scale=5.0, **make_engine.spec.model_shape)
    return save_hf_folder(model, tmp_path_factory.mktemp("conformance") / "other")


@pytest.fixture(scope="session")
def reference(model_dir) -> DecoderLM:
    """The oracle: the plain PyTorch model read from the same folder."""
    return load_hf_folder(model_dir).eval()


@pytest.fixture(scope="session")
def trained_eagle3(tmp_path_factory) -> TrainedEagle3:
    """The demo target and a trained EAGLE-3 drafter of it, exported with ``write_eagle3_hf``:
    the one cached under $NEMO_TLT_CACHE by ``demo.assets.prepare_eagle3_drafter`` where present
    (or trained, on a CUDA host or with NEMO_TLT_TRAIN_EAGLE3=1: about 105 minutes on one CPU
    thread, docs/benchmarks.md), else the one shipped with the package
    (``demo_assets/drafter_eagle3``, made by ``nemo-tlt drafter train --type eagle3``)."""
    train = torch.cuda.is_available() or os.environ.get("NEMO_TLT_TRAIN_EAGLE3") == "1"
    folder = tmp_path_factory.mktemp("trained-eagle3")
    try:
        return export_trained_eagle3(folder, train_if_missing=train)
    except DrafterNotCached:
        drafter = load_drafter(shipped_eagle3_drafter())
        write_eagle3_hf(drafter, folder)
        return TrainedEagle3(SHIPPED_DIR / "target", folder, tuple(drafter.capture_layers), None)
