"""ShardedCheckpoints (2 gloo ranks, each writing its own file): the commit is the rename of a
folder holding a manifest of every rank's files; partial, truncated and (with verify) corrupted
checkpoints are skipped; the newest keep_last are kept. The kill -9 case with megatron-core's
sharded policy files is in tests/policy/test_megatron_sharded_checkpoint.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sharded_workers import latest, save_steps  # noqa: E402

from ranks import launch_forked  # noqa: E402


def test_commit_prune_and_skip_broken(tmp_path):
    root = tmp_path / "ck"
    names = launch_forked(save_steps, 2, str(root), [1, 2, 3], timeout_s=120)[0]
    assert names == ["step-00000002", "step-00000003"]  # keep_last=2
    manifest = json.loads((root / "step-00000003" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["shard-0.bin", "shard-1.bin"] and manifest["world"] == 2
    (root / ".step-00000004.partial-sharded").mkdir()  # a killed save: ignored
    assert launch_forked(latest, 2, str(root), False, timeout_s=120) == [3, 3]
    shard = root / "step-00000003" / "shard-1.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # same size, other bytes: only the hash sees it
    shard.write_bytes(bytes(data))
    assert launch_forked(latest, 2, str(root), False, timeout_s=120) == [3, 3]
    assert launch_forked(latest, 2, str(root), True, timeout_s=120) == [2, 2]
    shard.write_bytes(bytes(data[:10]))  # truncated: the sizes see it
    assert launch_forked(latest, 2, str(root), False, timeout_s=120) == [2, 2]
