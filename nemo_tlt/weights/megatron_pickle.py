"""Load Megatron ``.pt`` files (``torch.save`` pickles) without running code they might carry.

Contract: ``load_megatron_pickle(path, trust_pickle=False)`` returns what the file
holds. By default it uses ``torch.load(weights_only=True)`` and allows, beyond
tensors and plain containers, only what Megatron-LM's legacy ``save_checkpoint``
(``--ckpt-format torch``) writes: ``args`` (an ``argparse.Namespace`` that may
hold ``pathlib`` paths, ``types.SimpleNamespace`` values and megatron-core
enums), ``rng_state`` (numpy's RNG state: arrays, dtypes, scalars), and the
``OptimizerConfig``, rerun-state-machine enums, ``io.BytesIO`` and
``signal.Signals`` that megatron-core itself allow-lists for its checkpoints
(``megatron/core/safe_globals.py``, megatron-core 0.16). megatron-core entries
are looked up only when a file names them, and only where megatron-core is
installed (without it, such a file cannot be unpickled at all).

Anything else raises ``UntrustedPickleError`` (a ValueError) naming the file,
the global and ``--trust-pickle``; ``trust_pickle=True`` loads with full pickle
(``weights_only=False``), which runs whatever code the file carries: only for
files you trust.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import pathlib
import pickle
import re
import signal
import types
from typing import Any

import numpy as np
import torch

try:
    from numpy._core import multiarray as _np_multiarray  # numpy >= 2
except ImportError:
    from numpy.core import multiarray as _np_multiarray  # numpy 1.x

# Always allowed: the standard-library types megatron-core lists, and numpy's RNG state
# pieces. numpy 2 pickles its helpers from numpy._core, numpy 1.x from numpy.core: files
# written under either are read under either.
_NUMPY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                 np.uint64, np.float16, np.float32, np.float64)
_BASE_GLOBALS: tuple[Any, ...] = (
    argparse.Namespace, types.SimpleNamespace, io.BytesIO, signal.Signals,
    # Python <= 3.12 pickles PosixPath as pathlib.PosixPath, 3.13 as pathlib._local.PosixPath
    *((pathlib.PosixPath, f"{mod}.PosixPath") for mod in ("pathlib", "pathlib._local")),
    np.ndarray, np.dtype, *(type(np.dtype(t)) for t in _NUMPY_DTYPES),
    *((getattr(_np_multiarray, fn), f"{pkg}.multiarray.{fn}")
      for fn in ("_reconstruct", "scalar") for pkg in ("numpy._core", "numpy.core")),
)
_BASE_NAMES = frozenset(g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"
                        for g in _BASE_GLOBALS)

# megatron-core types found in Megatron-LM checkpoints, by the name a pickle records.
# ModelType moved from transformer.enums to megatron.core.enums; both names occur.
_MEGATRON_GLOBALS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
)

_GLOBAL_IN_ERROR = re.compile(r"GLOBAL (\S+) was not an allowed global")


class UntrustedPickleError(ValueError):
    """A checkpoint file holds a Python global outside the allow-list."""


def _megatron_globals(names: set[str] | None) -> list[tuple[Any, str]]:
    """The allow-listed megatron-core globals among ``names`` (all of them when None), as
    (object, pickled name); those megatron-core does not define here are skipped."""
    found = []
    for full in _MEGATRON_GLOBALS:
        if names is not None and full not in names:
            continue
        module, _, attr = full.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue  # not installed, or a version without it: the file cannot name it usefully
        found.append((obj, full))
    return found


def _named_globals(path: str) -> set[str] | None:
    """Globals the pickle names beyond torch's defaults, read without unpickling; None for
    files in torch's pre-1.6 format, which cannot be scanned."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except ValueError:
        return None


def _refusal(path: str, bad: str) -> UntrustedPickleError:
    return UntrustedPickleError(
        f"{path}: refusing to unpickle {bad}: it is not one of the types Megatron-LM checkpoints hold "
        "(argparse.Namespace, numpy RNG state, megatron-core enums). If you trust this file, rerun with "
        "--trust-pickle (trust_pickle=True), which loads it with full pickle and runs any code it carries")


def load_megatron_pickle(path: str | os.PathLike, trust_pickle: bool = False) -> Any:
    path = str(path)
    if trust_pickle:
        return torch.load(path, map_location="cpu", weights_only=False)
    names = _named_globals(path)
    megatron = _megatron_globals(names)
    if names is not None:
        unknown = names - _BASE_NAMES - {name for _, name in megatron}
        uninstalled = sorted(unknown & set(_MEGATRON_GLOBALS))
        if uninstalled:
            raise ValueError(f"{path}: holds {', '.join(uninstalled)}; install megatron-core (the version "
                             "that wrote the checkpoint) to read it")
        if unknown:
            raise _refusal(path, ", ".join(sorted(unknown)))
    try:
        with torch.serialization.safe_globals([*_BASE_GLOBALS, *megatron]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # Reached for what the scan cannot see (an object of a type that is not allowed to be
        # built) and for pre-1.6 files, which are not scanned.
        match = _GLOBAL_IN_ERROR.search(str(err))
        detail = match.group(1) if match else str(err).rsplit("WeightsUnpickler error:", 1)[-1].strip()
        raise _refusal(path, detail) from err
