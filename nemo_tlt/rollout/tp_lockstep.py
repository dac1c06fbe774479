"""Lockstep of a tensor-parallel rollout: every rank of a TP group runs the same
`generate`, TP rank 0 takes the one decision that could differ, and every rank checks
that they all produced the same tokens.

Contract
--------
Given identical requests, sampling and weights, everything the engine does is
deterministic on every rank (the hidden states after an all-reduce and the gathered
logits are identical there), except the SD policy's choice: a policy measures wall time
per rank. So `lead_shape` consults only TP rank 0's policy and broadcasts its choice
(one broadcast of three ints per choice: every decode step of the torch engine; vLLM's
steps that hold the last choice make none); the other ranks' policies are not called
at all (``begin_rollout`` / ``choose`` / ``observe``), so nothing rank-local reaches the
tokens. A ``choose`` that fails on rank 0 fails the step on every rank (no rank is left
waiting in a collective).

`check_ready` (before decoding) and `check_agreement` (after) each make one all-gather
of one int64: a rank that cannot generate (its last weight load failed midway) stops
every rank; results whose 64-bit digest (tokens and stop reasons, in request order)
differs from TP rank 0's raise a RuntimeError naming the diverged ranks.
`check_same_inputs` (before decoding, vLLM's members, which each run a scheduler of their
own) does the same for a digest of the call's inputs: requests, sampling and whether a
drafter is loaded.
"""
from __future__ import annotations

import hashlib
from typing import Any

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.rollout.protocol import RequestResult
from nemo_tlt.speculative.tree_shape import TreeShape

_PLAIN = [0, 0, 0]
_FAILED = [-1, -1, -1]


def lead_shape(tp: TensorParallel | None, policy: SpecPolicy | None, running: int) -> TreeShape | None:
    """TP rank 0's ``policy.choose(running)``, on every rank (None: plain); without a group
    (``tp`` None) this process's ``policy.choose(running)``."""
    if tp is None:
        return policy.choose(running) if policy is not None else None
    if tp.rank != 0:
        code = tp.broadcast_ints(_PLAIN)
        if code == _FAILED:
            raise RuntimeError("tensor parallel generate: TP rank 0's SD policy failed to choose a step (its "
                               "error is raised there); this rank stops with it")
        return None if code == _PLAIN else TreeShape(*code)
    try:
        shape = policy.choose(running) if policy is not None else None
    except BaseException:
        tp.broadcast_ints(_FAILED)
        raise
    tp.broadcast_ints(_PLAIN if shape is None else [shape.depth, shape.topk, shape.num_verify])
    return shape


def check_ready(tp: TensorParallel | None, error: BaseException | None) -> None:
    """Raise on every rank if any rank of the group cannot generate (``error`` is this rank's reason);
    without a group (``tp`` None) raise ``error`` when there is one."""
    if tp is None:
        if error is not None:
            raise error
        return
    failed = [r for r, flag in enumerate(tp.gather_int(int(error is not None))) if flag]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"tensor parallel generate: TP ranks {failed} (global {_global(tp, failed)}) cannot "
                           "generate (see their errors); this rank stops with them")


def check_same_inputs(tp: TensorParallel, requests: list, sampling: Any, drafter_loaded: bool) -> None:
    """Raise a RuntimeError on every rank unless every rank's call has TP rank 0's inputs."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((sampling, drafter_loaded)).encode())
    for r in requests:
        h.update(f"{r.seq_id}:{','.join(map(str, r.prompt))};".encode())
    digests = tp.gather_int(int.from_bytes(h.digest(), "little", signed=True))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"tensor parallel generate: TP ranks {differ} (global {_global(tp, differ)}) were called "
                           "with other requests, sampling or drafter state than TP rank 0: every member of the "
                           "group must make the same calls")


def results_digest(results: list[RequestResult]) -> int:
    """A signed 64-bit digest of the results' tokens and stop reasons, in order."""
    h = hashlib.blake2b(digest_size=8)
    for r in results:
        h.update(f"{r.stop_reason}:{','.join(map(str, r.tokens))};".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def check_agreement(tp: TensorParallel, results: list[RequestResult]) -> None:
    """Raise a RuntimeError on every rank unless all ranks' results have TP rank 0's digest."""
    digests = tp.gather_int(results_digest(results))
    diverged = [r for r, d in enumerate(digests) if d != digests[0]]
    if diverged:
        raise RuntimeError(f"tensor parallel generate: TP ranks {diverged} (global {_global(tp, diverged)}) "
                           "returned tokens different from TP rank 0's: the replicas diverged (their inputs, "
                           "weights, drafter or sampling differ)")


def _global(tp: TensorParallel, ranks: list[int]) -> list[int]:
    return [tp.global_rank(r) for r in ranks]
