"""The pipelined update's work list: every published piece (a group's micro-batch) is claimed by exactly one rank,
claim waits for publications and ends once all are seen, a missing group times out by name;
the collector publishes a group when its last row finishes; stats combine in gid order."""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from nemo_tlt.rl.update.group_board import Group, GroupBoard, board_prefix, cleanup
from nemo_tlt.rl.update.pipelined_update import GroupCollector, claim_all, combine
from nemo_tlt.rollout.protocol import Request, RequestResult


def _group(gid: int, owner: int = 0) -> Group:
    return Group(gid, (1, 2), [[3, gid]], [float(gid)], [[-0.5, -0.25]], owner)


def test_each_piece_is_claimed_once_across_racing_ranks():
    store, n = dist.HashStore(), 24
    prefix = board_prefix("tlt", 3)
    boards = [GroupBoard(store, prefix, n, timeout_s=30, parts_of=lambda g: 1 + g.gid % 2) for _ in range(3)]
    claimed: list[list[tuple[int, int]]] = [[] for _ in boards]

    def worker(k: int) -> None:
        while (got := boards[k].claim()) is not None:
            claimed[k].append((got[0].gid, got[1]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for gid in range(n):  # published while the claimers wait
        boards[gid % 3].publish(_group(gid, gid % 3))
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(g for c in claimed for g in c) == [(g, k) for g in range(n) for k in range(1 + g % 2)]
    cleanup(store, prefix, n, parts=2)
    assert not store.check([f"{prefix}/pub/0"]) and not store.check([f"{prefix}/group/5"])


def test_claim_returns_the_group_as_published():
    board = GroupBoard(dist.HashStore(), "p", 1, timeout_s=5)
    board.publish(_group(0, owner=1))
    got = board.claim()
    assert got == (_group(0, owner=1), 0) and board.claim() is None


def test_pieces_of_one_group_go_to_different_ranks():
    store = dist.HashStore()
    a, b = (GroupBoard(store, "s", 1, timeout_s=5, parts_of=lambda g: 3) for _ in range(2))
    a.publish(_group(0))
    assert a.claim()[1] == 0 and b.claim()[1] == 1 and a.claim()[1] == 2
    assert a.claim() is None and b.claim() is None


def test_a_group_never_published_times_out_naming_the_step():
    board = GroupBoard(dist.HashStore(), board_prefix("tlt", 7), 2, timeout_s=0.2)
    board.publish(_group(0))
    assert board.claim()[0].gid == 0
    with pytest.raises(TimeoutError, match="1 of 2 groups of tlt/tlt/groups/7"):
        board.claim()


def test_collector_publishes_each_group_when_its_last_row_finishes():
    published: list[Group] = []
    collector = GroupCollector(2, lambda gid, toks: float(len(toks) + 10 * gid), rank=1, publish=published.append)
    ids = [4, 5, 6, 7]  # groups 2 and 3 of G = 2
    reqs = [Request((9, 2)), Request((9, 2)), Request((8,)), Request((8,))]
    collector.bind(reqs, ids)
    collector(3, RequestResult([1, 1, 1], "eos", logprobs=[-1.0, -1.0, -1.0]))
    collector(0, RequestResult([1], "eos", logprobs=[-2.0]))
    assert published == []
    collector(2, RequestResult([5], "eos", logprobs=[-3.0]))
    assert [g.gid for g in published] == [3]
    assert published[0].responses == [[5], [1, 1, 1]] and published[0].rewards == [31.0, 33.0]
    assert published[0].prompt == (8,) and published[0].owner == 1
    collector(1, RequestResult([2, 2], "length", logprobs=[-1.0, -1.0]))
    assert [g.gid for g in published] == [3, 2]
    assert collector.rewards(ids) == [21.0, 22.0, 31.0, 33.0]
    assert [g.gid for g in collector.own_groups()] == [2, 3]


def test_claim_all_times_each_group():
    board = GroupBoard(dist.HashStore(), "q", 2, timeout_s=5)
    for gid in (1, 0):
        board.publish(_group(gid))
    ticks = iter(range(100))
    sums, segments = claim_all(board, lambda g, part: {"gid": g.gid}, lambda: float(next(ticks)))
    assert sums == {(1, 0): {"gid": 1}, (0, 0): {"gid": 0}}
    assert segments == [(0.0, 1.0, "update"), (2.0, 3.0, "update")]


def test_combine_adds_groups_in_gid_order_whoever_computed_them():
    sums = {(g, 0): {"loss": 0.1 * (g + 1), "pg_loss": 1e-8 * g, "kl": 0.0, "clip_frac": 3.0,
                     "approx_kl": 1e8 / (g + 1), "tokens": 5.0} for g in range(6)}
    one = combine([sums], 30)
    split = combine([{(g, 0): sums[(g, 0)] for g in (5, 1, 3)}, {(g, 0): sums[(g, 0)] for g in (4, 0, 2)}], 30)
    assert one == split and one["clip_frac"] == pytest.approx(18.0 / 30)
