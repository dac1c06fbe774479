"""`ShardedCheckpoints`: checkpoints every rank writes its own part of, committed atomically.

Contract
--------
* Every method is collective over ``group`` (default: the world); the folder is on a file
  system every rank sees.
* ``save(step, write)`` (= ``begin(step)``, ``write``, ``commit(step)``; a caller whose
  writes end later calls the two itself): rank 0 makes an empty hidden ``.step-00000042.partial-sharded``
  folder; every rank calls ``write(folder)`` (e.g. megatron-core's ``dist_checkpointing.save``,
  where each rank writes its own shard files); then the files are hashed, each rank taking
  its share of them (nothing but file records travels to rank 0), and rank 0 writes
  ``manifest.json`` (every file with its size and SHA-256, as the drafter checkpoints,
  ``nemo_tlt.spot.checkpoint``), fsyncs the folder and renames it to ``step-00000042``:
  the commit. A rank killed at any moment before the rename leaves only the hidden
  folder, which readers ignore; the previous checkpoint stays loadable. The newest
  ``keep_last`` committed checkpoints are kept; stale partial folders of earlier steps are
  removed after a commit.
* ``latest()``: the newest committed step whose files match the manifest's sizes (with
  ``verify=True`` also their SHA-256, hashed by the ranks in shares), decided on rank 0 and
  the same on every rank; None when there is none. ``path(step)`` is its folder.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from nemo_tlt.atomic import file_record, fsync_path, fsync_tree

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _partial_name(step: int) -> str:
    return f".{_step_name(step)}.partial-sharded"


class ShardedCheckpoints:
    def __init__(self, directory: str | os.PathLike, keep_last: int = 2, group=None) -> None:
        if keep_last < 1:
            raise ValueError(f"ShardedCheckpoints: keep_last must be >= 1, got {keep_last}")
        self.directory, self.keep_last, self.group = Path(directory), keep_last, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def path(self, step: int) -> Path:
        return self.directory / _step_name(step)

    def _from_rank0(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    def _hash_shares(self, folder: Path, names: list[str]) -> dict[str, dict]:
        """SHA-256 and size of every file, each rank hashing ``names[rank::world]``; on rank 0."""
        mine = {name: file_record(folder / name) for name in names[self.rank::self.world]}
        box = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, box, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                           group=self.group)
        return {k: v for part in (box or []) for k, v in part.items()}

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        partial = self.begin(step)
        write(partial)
        return self.commit(step)

    def begin(self, step: int) -> Path:
        """The empty hidden folder every rank writes step ``step``'s files into."""
        partial = self.directory / _partial_name(step)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier(group=self.group)
        return partial

    def commit(self, step: int) -> Path:
        """After every rank's files of ``begin(step)``'s folder are written: hash, manifest, rename."""
        partial = self.directory / _partial_name(step)
        dist.barrier(group=self.group)
        names = self._from_rank0(sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
                                 if self.rank == 0 else None)
        records = self._hash_shares(partial, names)
        final = self.path(step)
        if self.rank == 0:
            manifest = {"format_version": FORMAT_VERSION, "step": step, "created_unix": time.time(),
                        "world": self.world, "files": records}
            (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            fsync_tree(partial)
            # a step saved again: the old copy is renamed aside (a hidden name, never loaded)
            # before the new one takes its place, so a crash in between leaves the previous
            # checkpoint (step - 1, or this step's old copy under its aside name) intact
            aside = final.with_name(f".{final.name}.replaced")
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
                final.rename(aside)
                fsync_path(self.directory)
            partial.rename(final)
            fsync_path(self.directory)
            shutil.rmtree(aside, ignore_errors=True)
            self._prune(step)
        dist.barrier(group=self.group)
        return final

    def _committed(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            if entry.is_dir() and entry.name.startswith("step-") and entry.name[5:].isdigit():
                steps.append(int(entry.name[5:]))
        return sorted(steps)

    def problem(self, step: int) -> str | None:
        """Why checkpoint ``step`` is unusable by sizes (any rank may ask), or None."""
        path = self.path(step)
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        except FileNotFoundError:
            return f"{path} has no {MANIFEST_FILE}"
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{path}/{MANIFEST_FILE} is unreadable ({err})"
        if manifest.get("format_version") != FORMAT_VERSION:
            return f"{path}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}"
        for name, record in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"{path}: file {name} listed in the manifest is missing"
            if file.stat().st_size != record["bytes"]:
                return f"{path}: file {name} has {file.stat().st_size} bytes, the manifest says {record['bytes']}"
        return None

    def latest(self, verify: bool = False) -> int | None:
        """The newest usable committed step (see the module docstring), the same on every rank."""
        candidates = self._from_rank0(self._committed()[::-1] if self.rank == 0 else None)
        for step in candidates:
            why = self._from_rank0(self.problem(step) if self.rank == 0 else None)
            if why is None and verify:
                why = self._hash_problem(step)
            if why is None:
                return step
            if self.rank == 0:
                log.warning("sharded checkpoint step %d skipped: %s", step, why)
        return None

    def _hash_problem(self, step: int) -> str | None:
        path = self.path(step)
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        names = sorted(manifest["files"])
        records = self._hash_shares(path, names)
        why = None
        if self.rank == 0:
            bad = [n for n in names if records[n]["sha256"] != manifest["files"][n]["sha256"]]
            why = f"{path}: {bad[0]} does not match its SHA-256 (corrupted)" if bad else None
        return self._from_rank0(why)

    def _prune(self, written: int) -> None:
        valid = [s for s in self._committed() if self.problem(s) is None]
        for step in valid[: max(len(valid) - self.keep_last, 0)]:
            shutil.rmtree(self.path(step))
        for entry in self.directory.iterdir():
            name = entry.name
            if name.startswith(".step-") and name.endswith(".partial-sharded") and entry.is_dir():
                if int(name[len(".step-"):-len(".partial-sharded")]) < written:
                    shutil.rmtree(entry)  # a killed save's leftovers
