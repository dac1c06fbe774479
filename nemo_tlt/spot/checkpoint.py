"""`CheckpointManager`: asynchronous, atomic, self-validating checkpoints.

Contract
--------
* ``save_async(step, tensors, extra_state, json_state)`` snapshots everything on the
  calling thread (tensors cloned to host memory, nested state deep-copied, JSON
  encoded), then writes in one background thread, so the caller is blocked only for
  the copy. ``save_sync`` does the same work on the calling thread.
* Layout of one checkpoint, ``<directory>/step-00000042/``:
  ``weights.safetensors`` (the named tensors), ``extra_state.pt`` (``torch.save`` of
  ``extra_state``: optimizer state, RNG states ...; tensors and plain containers and
  scalars only, as it is read back with ``torch.load(weights_only=True)``),
  ``state.json`` (JSON-able state: bandit, step counters ...; must survive a JSON
  round trip exactly), and ``manifest.json`` written last, listing every file
  with its size and SHA-256 and every tensor with its shape and dtype.
* Atomicity (``nemo_tlt.atomic.atomic_output_dir``): files are written into a hidden
  ``.step-00000042.partial-*`` folder, fsynced, and the folder is renamed to
  ``step-00000042`` (``os.rename`` is atomic within one file system), then the parent
  folder is fsynced. A writer killed at any moment leaves at most a hidden partial
  folder, which readers ignore; the previous checkpoint stays loadable.
* Keeps the newest ``keep_last`` valid checkpoints; older ones and stale temp folders
  of earlier steps are deleted after each successful write.
* ``latest()`` / ``load(step=None)`` consider only folders whose manifest is present
  and whose files match it; an invalid one is skipped with a warning (``latest``) or
  refused with a ValueError saying what is wrong (``load(step)``).
  ``load(expected_shapes=...)`` refuses, before reading any weights, a checkpoint
  whose tensors do not match: the ValueError names the tensor and both shapes.
* One writer per directory (the manager that owns it); any number of readers.
* A background write failure is re-raised on the caller's thread by the next
  ``save_async`` / ``save_sync`` / ``wait`` call: failing to checkpoint is never silent.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.atomic import atomic_output_dir, file_record, sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
EXTRA_FILE = "extra_state.pt"
JSON_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# A killed writer's leftovers: atomic_output_dir's partial folders (and the older ``.tmp-step-N``).
_TMP_DIR = re.compile(r"^\.(?:tmp-step-(\d+)|step-(\d+)\.partial-.+)$")


@dataclass(frozen=True)
class Checkpoint:
    """What `load` returns: exactly what was saved."""

    step: int
    tensors: dict[str, torch.Tensor]
    extra_state: dict[str, Any]
    json_state: dict[str, Any]
    path: Path


@dataclass(frozen=True)
class _Snapshot:
    step: int
    tensors: dict[str, torch.Tensor]
    extra_state: dict[str, Any]
    json_text: str


class CheckpointManager:
    """Writes and reads the checkpoints of one directory. See the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int = 3,
        fsync: bool = True,
        verify: bool = True,
        max_pending: int = 1,
    ) -> None:
        for name, value in (("keep_last", keep_last), ("max_pending", max_pending)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CheckpointManager.{name} must be a positive int, got {value!r}")
        self.max_pending = max_pending  # background writes queued before save_async waits
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.fsync = fsync
        self.verify = verify  # check SHA-256 of every file on load (reads each file twice)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tlt-ckpt")
        self._pending: list[Future] = []
        self.last_blocked_s = 0.0  # caller-thread time of the last save (snapshot, or all of a sync save)

    # ------------------------------------------------------------------- writing

    def save_async(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        extra_state: dict[str, Any] | None = None,
        json_state: dict[str, Any] | None = None,
    ) -> Future:
        """Snapshot now, write in the background; the Future resolves to the checkpoint path."""
        self._raise_failed()
        while len(self._pending) >= self.max_pending:
            # Bound the host memory held by queued snapshots: wait for the oldest write.
            self._pending.pop(0).result()
        snapshot = self._snapshot(step, tensors, extra_state, json_state)
        future = self._executor.submit(self._write, snapshot)
        self._pending.append(future)
        return future

    def save_sync(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        extra_state: dict[str, Any] | None = None,
        json_state: dict[str, Any] | None = None,
    ) -> Path:
        """Snapshot and write on the calling thread (after any pending background writes)."""
        self.wait()
        start = time.perf_counter()
        path = self._write(self._snapshot(step, tensors, extra_state, json_state))
        self.last_blocked_s = time.perf_counter() - start
        return path

    def wait(self) -> None:
        """Block until every background write is done; re-raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """Steps of the valid checkpoints, ascending (invalid ones are skipped with a warning)."""
        valid = []
        for step, path in self._step_dirs():
            problem = self._problem(path)
            if problem is None:
                valid.append(step)
            else:
                log.warning("skipping checkpoint %s: %s", path, problem)
        return valid

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(
        self,
        step: int | None = None,
        expected_shapes: dict[str, tuple[int, ...] | torch.Size] | None = None,
    ) -> Checkpoint:
        """Load checkpoint `step` (default: the newest valid one), validated against its manifest."""
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"no valid checkpoint in {self.directory}")
        path = self.directory / _step_name(step)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint for step {step} not found: {path}")
        problem = self._problem(path, hash_files=self.verify)
        if problem is not None:
            raise ValueError(f"refusing checkpoint {path}: {problem}")
        manifest = _read_manifest(path)
        if expected_shapes is not None:
            check_shapes(manifest["tensors"], expected_shapes, path)
        tensors = load_file(str(path / WEIGHTS_FILE), device="cpu")
        for name, meta in manifest["tensors"].items():
            if list(tensors[name].shape) != meta["shape"]:
                raise ValueError(f"refusing checkpoint {path}: tensor {name!r} disagrees with its manifest")
        extra = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
        state = json.loads((path / JSON_FILE).read_text())
        return Checkpoint(step=manifest["step"], tensors=tensors, extra_state=extra, json_state=state, path=path)

    # ----------------------------------------------------------------- internals

    def _snapshot(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        extra_state: dict[str, Any] | None,
        json_state: dict[str, Any] | None,
    ) -> _Snapshot:
        start = time.perf_counter()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"CheckpointManager: step must be an int >= 0, got {step!r}")
        for name, tensor in tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"CheckpointManager: tensors must map str -> Tensor, got {name!r}: {type(tensor).__name__}"
                )
        json_state = {} if json_state is None else json_state
        try:
            json_text = json.dumps(json_state, sort_keys=True)
        except TypeError as err:
            raise ValueError(
                f"CheckpointManager: json_state is not JSON-serializable ({err}); use extra_state"
            ) from None
        if json.loads(json_text) != json_state:
            raise ValueError(
                "CheckpointManager: json_state does not survive a JSON round trip (tuples, non-str keys, NaN?); "
                "put such state in extra_state instead"
            )
        snapshot = _Snapshot(
            step=step,
            tensors={name: _host_copy(t) for name, t in tensors.items()},
            extra_state=_deep_host_copy({} if extra_state is None else extra_state),
            json_text=json_text,
        )
        self.last_blocked_s = time.perf_counter() - start
        return snapshot

    def _write(self, snap: _Snapshot) -> Path:
        final = self.directory / _step_name(snap.step)
        with atomic_output_dir(final, overwrite=True, fsync=self.fsync) as tmp:
            save_file(snap.tensors, str(tmp / WEIGHTS_FILE), metadata={"step": str(snap.step)})
            torch.save(snap.extra_state, tmp / EXTRA_FILE)
            (tmp / JSON_FILE).write_text(snap.json_text)
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": snap.step,
                "created_unix": time.time(),
                "files": {name: file_record(tmp / name) for name in (WEIGHTS_FILE, EXTRA_FILE, JSON_FILE)},
                "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype)} for n, t in snap.tensors.items()},
            }
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        self._prune(snap.step)
        return final

    def _prune(self, written_step: int) -> None:
        valid = [step for step, path in self._step_dirs() if self._problem(path) is None]
        for step in valid[: max(len(valid) - self.keep_last, 0)]:
            shutil.rmtree(self.directory / _step_name(step))
        for entry in self.directory.iterdir():
            match = _TMP_DIR.match(entry.name)
            if match and int(match.group(1) or match.group(2)) < written_step and entry.is_dir():
                shutil.rmtree(entry)  # a killed writer's leftovers; this manager is the only writer

    def _step_dirs(self) -> list[tuple[int, Path]]:
        found = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def _problem(self, path: Path, hash_files: bool = False) -> str | None:
        """Why the checkpoint at `path` is unusable, or None when it is complete."""
        try:
            manifest = _read_manifest(path)
        except FileNotFoundError:
            return f"it has no {MANIFEST_FILE} (an interrupted or foreign write)"
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            return f"its {MANIFEST_FILE} is unreadable ({err})"
        if manifest["format_version"] != FORMAT_VERSION:
            return f"format_version {manifest['format_version']} is not {FORMAT_VERSION}"
        for name, record in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"file {name} listed in the manifest is missing"
            size = file.stat().st_size
            if size != record["bytes"]:
                return f"file {name} has {size} bytes, the manifest says {record['bytes']} (partial write?)"
            if hash_files and sha256_file(file) != record["sha256"]:
                return f"file {name} does not match its SHA-256 in the manifest (corrupted)"
        return None

    def _raise_failed(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()  # re-raises a background failure on the caller's thread


def check_shapes(
    saved: dict[str, dict[str, Any]], expected: dict[str, tuple[int, ...] | torch.Size], path: Path | str = "checkpoint"
) -> None:
    """Raise ValueError unless `saved` (manifest tensor records) has exactly the `expected` shapes."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"refusing checkpoint {path}: tensor names do not match the target; "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name in sorted(expected):
        want, have = list(expected[name]), saved[name]["shape"]
        if want != have:
            raise ValueError(
                f"refusing checkpoint {path}: tensor {name!r} has shape {tuple(have)} "
                f"but the target expects {tuple(want)}"
            )


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    missing = [key for key in ("format_version", "step", "files", "tensors") if key not in manifest]
    if missing:
        raise KeyError(f"manifest lacks {missing}")
    return manifest


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A private, contiguous CPU copy (safetensors refuses views and shared storage)."""
    return tensor.detach().to(device="cpu", copy=True).contiguous()


def _deep_host_copy(obj: Any) -> Any:
    """Copy nested state so later in-place updates (optimizer steps) cannot leak into the snapshot."""
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj)
    if type(obj) is dict:
        return {k: _deep_host_copy(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_deep_host_copy(v) for v in obj)
    return copy.deepcopy(obj)
