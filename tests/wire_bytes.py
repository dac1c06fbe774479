"""Bytes on the wire, counted where they leave and arrive: at torch.distributed's calls.

`WireBytes` wraps the tensor collectives and point-to-point functions of
``torch.distributed`` (in the package and in ``distributed_c10d``, so that ``P2POp`` /
``batch_isend_irecv`` see the wrapped ``isend`` / ``irecv`` as theirs) and sums, on this
rank, the bytes of every tensor that arrived from another rank (``received``) or left
for one (``sent``): independent of any meter the code under test keeps by hand. Object
collectives (``all_gather_object``, ...) are coordination; the tensor traffic they make
inside is not counted, and a tensor inside one of their objects fails at once (weights
must not travel there, unseen).

``counted_call(fn, ctx, *args)`` runs a launched rank function under it and returns
``{"result": ..., "wire": {label: (received, sent)}}``, one entry per call of
``stream_reshard`` / ``gather_reshard`` (labelled ``"stream-<i>"`` / ``"gather-<i>"``
in call order).
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_src(kwargs: dict, args: tuple, group) -> int:
    """The global rank of a call's ``src`` (positional or keyword; ``group_src`` is a group rank)."""
    if kwargs.get("group_src") is not None:
        return dist.get_global_rank(group, kwargs["group_src"])
    return kwargs["src"] if "src" in kwargs else args[0]


class WireBytes:
    TENSOR_CALLS = ("broadcast", "send", "recv", "isend", "irecv", "all_gather", "all_gather_into_tensor",
                    "gather", "scatter", "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                    "all_to_all", "all_to_all_single")
    OBJECT_CALLS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                    "send_object_list", "recv_object_list")

    def __init__(self) -> None:
        self.received = self.sent = 0
        self.calls: Counter = Counter()
        self._depth = 0  # wrapped calls under way (the code under test calls from one thread)
        self._saved: list[tuple[object, str, object]] = []

    # ---- what one call moves, on this rank ------------------------------------------
    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        me = dist.get_rank()
        if name == "broadcast":
            tensor, rest = (kwargs["tensor"], args) if "tensor" in kwargs else (args[0], args[1:])
            src = _group_src(kwargs, rest, group)
            n = _nbytes(tensor)
            if me == src:
                self.sent += n * (dist.get_world_size(group) - 1)
            else:
                self.received += n
        elif name in ("send", "isend"):
            self.sent += _nbytes(kwargs.get("tensor", args[0] if args else None))
        elif name in ("recv", "irecv"):
            self.received += _nbytes(kwargs.get("tensor", args[0] if args else None))
        else:
            # collectives the reshard does not use: every tensor in the call counts as arrived,
            # so that one showing up cannot match a plan that has none
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a])
                       if isinstance(t, torch.Tensor)]
            self.received += _nbytes(*tensors)

    # ---- wrapping -----------------------------------------------------------------------
    def _tensor_wrapper(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # the outermost call only: torch re-enters a wrapped function through a
            # __torch_function__ mode (megatron_patches.cpu_shims) and from one call inside another
            if not self._depth:
                self.calls[name] += 1
                self._count(name, args, kwargs)
            return self._nested(fn, args, kwargs)
        return wrapper

    def _object_wrapper(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for obj in (*args, *kwargs.values()):
                if any(isinstance(t, torch.Tensor) for t in _leaves(obj)):
                    raise AssertionError(f"torch.distributed.{name} carries a tensor: tensors must travel "
                                         "through the tensor calls, where they are counted")
            self.calls[name] += 1
            return self._nested(fn, args, kwargs)
        return wrapper

    def _nested(self, fn: Callable, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` with the calls it makes itself not counted again."""
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1

    def __enter__(self) -> "WireBytes":
        for names, wrap in ((self.TENSOR_CALLS, self._tensor_wrapper), (self.OBJECT_CALLS, self._object_wrapper)):
            for name in names:
                original = getattr(c10d, name)
                wrapped = wrap(name, original)
                for module in (dist, c10d):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


def _leaves(obj, depth: int = 0):
    if depth > 8:
        return
    if isinstance(obj, dict):
        obj = [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _leaves(item, depth + 1)
    else:
        yield obj


def counted_call(fn: Callable, ctx, *args) -> dict:
    """``fn(ctx, *args)`` with every ``stream_reshard`` / ``gather_reshard`` call's wire bytes."""
    from nemo_tlt.weights import reshard

    wire: dict[str, tuple[int, int]] = {}
    originals = {name: getattr(reshard, name) for name in ("stream_reshard", "gather_reshard")}

    def measured(label: str, original: Callable) -> Callable:
        def call(*a, **kw):
            with WireBytes() as seen:
                out = original(*a, **kw)
            wire[f"{label}-{sum(k.startswith(label) for k in wire)}"] = (seen.received, seen.sent)
            return out
        return call

    reshard.stream_reshard = measured("stream", originals["stream_reshard"])
    reshard.gather_reshard = measured("gather", originals["gather_reshard"])
    try:
        result = fn(ctx, *args)
    finally:
        for name, original in originals.items():
            setattr(reshard, name, original)
    return {"result": result, "wire": wire}
