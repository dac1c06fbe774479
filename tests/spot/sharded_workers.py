"""Gloo worker for tests/spot/test_sharded_checkpoint.py."""
from __future__ import annotations

from pathlib import Path

from nemo_tlt.dist import RankContext
from nemo_tlt.spot.sharded_checkpoint import ShardedCheckpoints


def _write(step: int, rank: int):
    def write(folder: Path) -> None:
        (folder / f"shard-{rank}.bin").write_bytes(bytes([step, rank]) * 1000)
    return write


def save_steps(ctx: RankContext, root: str, steps: list[int]) -> list[str] | None:
    ckpts = ShardedCheckpoints(root, keep_last=2)
    for step in steps:
        ckpts.save(step, _write(step, ctx.rank))
    return sorted(p.name for p in Path(root).iterdir()) if ctx.rank == 0 else None


def latest(ctx: RankContext, root: str, verify: bool) -> int | None:
    found = ShardedCheckpoints(root).latest(verify=verify)
    return found
