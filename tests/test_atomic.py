"""nemo_tlt.atomic: the one atomic writer (folders renamed into place, fsync on request)."""
import os

import pytest

from nemo_tlt import atomic
from nemo_tlt.atomic import atomic_output_dir


def test_fsync_reaches_every_file_the_folder_and_its_parent(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(atomic, "fsync_path", lambda path: synced.append(os.path.basename(str(path))))
    target = tmp_path / "out"
    with atomic_output_dir(target, fsync=True) as tmp:
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b")
        partial = tmp.name
    assert sorted(synced[:-2]) == ["a.bin", "b.bin", "sub"]  # contents first ...
    assert synced[-2:] == [partial, tmp_path.name]  # ... then the folder, and its parent after the rename
    assert (target / "sub" / "b.bin").read_bytes() == b"b"


def test_no_fsync_unless_asked_and_a_failure_leaves_the_old_output(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(atomic, "fsync_path", synced.append)
    target = tmp_path / "out"
    with atomic_output_dir(target) as tmp:
        (tmp / "x").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(target, overwrite=True, fsync=True) as tmp:
            (tmp / "x").write_text("new")
            raise RuntimeError("writer died")
    assert synced == [] and (target / "x").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
