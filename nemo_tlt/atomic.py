"""Write outputs atomically, and record files for later verification.

``write_json_atomic`` writes a temp file beside the target and renames it over it, so
a reader never sees half a file. ``file_record`` ({bytes, sha256}) is what manifests
and checkpoint metadata store to verify a file later.

Output folders: into a sibling temp folder, renamed into place on success.

Contract: ``with atomic_output_dir(path, overwrite=False) as tmp:`` yields a fresh
empty folder beside ``path`` (named ``.<name>.partial-*``); when the block succeeds,
``tmp`` becomes ``path`` (replacing an existing one only when ``overwrite``); when it
raises, ``tmp`` is deleted and ``path`` is untouched, so a failed conversion never
leaves a partial output. An existing ``path`` without ``overwrite`` is refused before
any work. With ``fsync=True`` every file under ``tmp`` and ``tmp`` itself reach the
disk before the rename, and the parent folder after it, so a power loss leaves either
the old output or the complete new one (a killed process leaves at most a
``.<name>.partial-*`` folder, which readers must ignore).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False, fsync: bool = False) -> Iterator[Path]:
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True (--overwrite on the command line) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_tree(tmp)
    if target.exists():
        # Move the old output aside first so there is never a moment with neither.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.rename(target)
    if fsync:
        fsync_path(target.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush one file or folder entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (``root`` last)."""
    for entry in sorted(root.rglob("*"), reverse=True):
        fsync_path(entry)
    fsync_path(root)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> Path:
    """``payload`` as indented JSON at ``path`` (parents created), via a temp file and a rename."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, out)
    return out


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """{bytes, sha256} of a file, as manifests store it."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}
