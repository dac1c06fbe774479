"""Write an output folder atomically: into a sibling temp folder, renamed into place on success.

Contract: ``with atomic_output_dir(path, overwrite=False) as tmp:`` yields a fresh
empty folder beside ``path``; when the block succeeds, ``tmp`` becomes ``path``
(replacing an existing one only when ``overwrite``); when it raises, ``tmp`` is
deleted and ``path`` is untouched, so a failed conversion never leaves a partial
output. An existing ``path`` without ``overwrite`` is refused before any work.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
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
    if target.exists():
        # Move the old output aside first so there is never a moment with neither.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.rename(target)
