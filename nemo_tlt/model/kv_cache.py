"""Batched, static-capacity KV cache with a per-row length.

Row b's committed keys/values live at slots [0, lengths[b]). A forward pass of T
new tokens writes them at slots lengths[b] + t without moving `lengths`; the
caller then either commits them all (`advance`) or keeps a subset (`compact`, used
after tree verification, where the accepted nodes are scattered through the
block). Slots at or beyond lengths[b] are never attended to, so stale entries
there are harmless and are simply overwritten. The capacity can start small and
grow (`reserve`), so a rollout whose responses are mostly short does not hold
cache for its longest possible response in every row.

Everything lives on the device the cache was built for. ``max_length`` is the host's
copy of ``lengths.max()`` where it is known without reading the device (an ``int``
advance keeps it; a caller that knows it says so with `set_lengths` or
`note_max_length`); where it is None, `write_index` reads it (one counted host sync,
nemo_tlt.model.host).
"""
from __future__ import annotations

import torch

from nemo_tlt.model.host import host_int, host_list


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"KVCache.capacity must be >= 1, got {capacity}")
        # One buffer for every layer's keys and values, so that compaction and row
        # selection are one gather/scatter instead of one per layer and tensor.
        self._buf = torch.zeros((2 * num_layers, batch, num_kv_heads, capacity, head_dim), dtype=dtype,
                                device=device)
        self._lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_length: int | None = 0
        self._alloc_rows = batch
        self._views()

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self.set_lengths(value)

    def set_lengths(self, value: torch.Tensor, max_length: int | None = None) -> None:
        """Replace the per-row lengths; `max_length` is their maximum if the caller knows it."""
        self._lengths = value
        self.max_length = max_length

    def note_max_length(self, max_length: int) -> None:
        """The caller read ``lengths.max()`` already: remember it (no sync)."""
        self.max_length = max_length

    @property
    def device(self) -> torch.device:
        return self._buf.device

    def _views(self) -> None:
        n = self._buf.shape[0] // 2
        self.k = [self._buf[i] for i in range(n)]
        self.v = [self._buf[n + i] for i in range(n)]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        """Bytes held by the buffer (after in-place row drops, more than the live rows use)."""
        return self._buf.untyped_storage().nbytes()

    def row_range(self, start: int, stop: int) -> "KVCache":
        """A cache over rows [start, stop) that shares this one's buffer and lengths (a
        view: writes and `advance` show through), e.g. to prefill a batch in chunks."""
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"KVCache.row_range: [{start}, {stop}) is not a row range of a batch of {self.batch}")
        view = KVCache.__new__(KVCache)
        view._buf = self._buf.narrow(1, start, stop - start)
        view._lengths = self.lengths[start:stop]
        view.max_length = self.max_length  # an upper bound is all a view's users need: see write_index
        view._alloc_rows = stop - start
        view._views()
        return view

    def known_max_length(self) -> int:
        """``lengths.max()``: the host's copy, or read from the device (one sync)."""
        if self.max_length is None:
            self.max_length = host_int(self.lengths.max()) if self.lengths.numel() else 0
        return self.max_length

    def write_index(self, num_new: int) -> torch.Tensor:
        """Slots [B, T] where a forward of `num_new` tokens writes."""
        idx = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)
        longest = self.known_max_length()
        if num_new and longest + num_new > self.capacity:
            raise ValueError(
                f"KVCache overflow: writing {num_new} tokens at length {longest} "
                f"exceeds capacity {self.capacity}"
            )
        return idx

    def advance(self, counts: torch.Tensor | int) -> None:
        self._lengths += counts  # in place: row_range views share it
        if isinstance(counts, int) and self.max_length is not None:
            self.max_length += counts
        else:
            self.max_length = None

    def compact(self, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep, per row, the block entries at offsets keep[b, :counts[b]] (ascending)
        of the last written block, moving them to offsets 0..counts[b]-1; then commit.

        keep: [B, K] long offsets into the last block (entries past counts[b] are ignored
        padding); counts: [B] long.
        """
        src = self.lengths[:, None] + keep
        dst = self.lengths[:, None] + torch.arange(keep.shape[1], device=keep.device)
        valid = torch.arange(keep.shape[1], device=keep.device)[None, :] < counts[:, None]
        # Padding entries copy a slot onto itself, which is a no-op.
        src = torch.where(valid, src, dst)
        L2, B, H, _, D = self._buf.shape
        shape = (L2, B, H, keep.shape[1], D)
        moved = self._buf.gather(3, src[None, :, None, :, None].expand(shape))  # gather first: may overlap
        self._buf.scatter_(3, dst[None, :, None, :, None].expand(shape), moved)
        self.advance(counts)

    def reserve(self, slots: int, limit: int | None = None) -> None:
        """Make room for `slots` slots per row. A growing buffer at least doubles (up to
        `limit`, never below `slots`), so a rollout regrows a few times only; committed
        slots move to the new buffer, the rest is zero."""
        if slots <= self.capacity:
            return
        cap = max(2 * self.capacity, slots) if limit is None else max(min(2 * self.capacity, limit), slots)
        self._buf = grow_slots(self._buf, 3, self.known_max_length(), cap)
        self._alloc_rows = self.batch
        self._views()

    def select_rows(self, rows: torch.Tensor | list[int], kept_max_length: int | None = None) -> None:
        """Drop finished rows: keep only `rows` (in that order; a host list saves reading a
        tensor back); `kept_max_length` is the longest kept row if the caller knows it.
        Only committed slots of rows that change position move (see `keep_rows`)."""
        used = self.known_max_length() if kept_max_length is None else kept_max_length
        self._buf, self._alloc_rows = keep_rows(self._buf, rows, used, 1, 3, self._alloc_rows)
        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long, device=self.device)
        self.set_lengths(self.lengths.index_select(0, index), kept_max_length)
        self._views()


def _zeros_resized(buf: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(buf.shape)
    shape[dim] = size
    return buf.new_zeros(shape)


def grow_slots(buf: torch.Tensor, slot_dim: int, used: int, slots: int) -> torch.Tensor:
    """A zeroed copy of a slot-indexed buffer with `slots` slots, carrying over [0, used)."""
    out = _zeros_resized(buf, slot_dim, slots)
    out.narrow(slot_dim, 0, used).copy_(buf.narrow(slot_dim, 0, used))
    return out


def fill_holes_order_host(alive: list[bool]) -> list[int]:
    """`fill_holes_order` of a host list of flags, as a host list."""
    n = sum(alive)
    order = list(range(n))
    movers = [i for i in range(len(alive) - 1, n - 1, -1) if alive[i]]
    for hole in (i for i in range(n) if not alive[i]):
        order[hole] = movers.pop(0)
    return order


def fill_holes_order(alive: torch.Tensor) -> torch.Tensor:
    """Row order after dropping the rows where `alive` [B] is False, moving as few as
    possible: the n live rows end up at positions 0..n-1, a live row already there stays
    put, and each hole is filled by a live row from past position n (last first).
    Returns the old row index of every new position, [n] long."""
    n = host_int(alive.sum())
    order = torch.arange(alive.numel(), device=alive.device)[:n].clone()
    holes = (~alive[:n]).nonzero().flatten()
    movers = alive[n:].nonzero().flatten().flip(0) + n
    order[holes] = movers
    return order


def row_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Group row moves dst[i] <- src[i] into runs of consecutive rows on both sides:
    (src_start, dst_start, length), in order."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def _copy_runs(out: torch.Tensor, buf: torch.Tensor, runs, used: int, row_dim: int, slot_dim: int) -> None:
    # One strided slice copy per run: on CPU, index_select / index_copy_ over a view cut
    # to `used` slots is far slower than these copies (figures: docs/benchmarks.md).
    for s, d, n in runs:
        out.narrow(row_dim, d, n).narrow(slot_dim, 0, used).copy_(
            buf.narrow(row_dim, s, n).narrow(slot_dim, 0, used))


def keep_rows(buf: torch.Tensor, rows: torch.Tensor | list[int], used: int, row_dim: int, slot_dim: int,
              alloc_rows: int) -> tuple[torch.Tensor, int]:
    """Keep `rows` of a slot-indexed batch buffer, carrying over only slots [0, used).

    A row drop happens every time a sequence finishes, so its cost matters: kept rows
    stay in the same allocation (the buffer becomes a view of its first rows) and only
    the rows whose position changes are copied, `used` slots each; with the order of
    `fill_holes_order` that is one row per finished sequence. Once the kept rows are at
    most half of the allocation (`alloc_rows`), they move to a fresh zeroed buffer
    instead, so the memory held stays within 2x of what the running rows need. Rows are
    copied as runs of consecutive rows (`row_runs`). Slots past `used` hold stale but
    finite values. `rows` may be a host list (a tensor is read back: one host sync).
    Returns (buffer, rows of its allocation)."""
    order = host_list(rows) if isinstance(rows, torch.Tensor) else list(rows)
    n = len(order)
    if 2 * n <= alloc_rows:
        out = _zeros_resized(buf, row_dim, n)
        _copy_runs(out, buf, row_runs(order, list(range(n))), used, row_dim, slot_dim)
        return out, n
    dst = [i for i, r in enumerate(order) if r != i]
    out = buf.narrow(row_dim, 0, n)
    if dst:
        src = [order[i] for i in dst]
        if set(src) & set(dst):  # a row both read and overwritten: read all before writing
            moved = buf.narrow(slot_dim, 0, used).index_select(row_dim, torch.tensor(src, device=buf.device))
            _copy_runs(out, moved, row_runs(list(range(len(dst))), dst), used, row_dim, slot_dim)
        else:
            _copy_runs(out, buf, row_runs(src, dst), used, row_dim, slot_dim)
    return out, alloc_rows
