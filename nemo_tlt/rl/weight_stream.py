"""The weight-sync stream: the policy's canonical weights, tensor by tensor, to the
rollout engine, with what else the step needs from the same pass.

``WeightStream(source, keep=..., view=..., tp=..., digest=...)`` is iterated once by the
engine's ``load_policy_weights``; as each (name, tensor) goes by it is hashed when ``digest``
(data-parallel replicas must end every step with the same bits: ``debug.weight_digests``;
the hashing copies each tensor to the host, ``digest_s`` its seconds), copied into the
drafter's view of the target when there is one, and kept by reference when ``keep`` (rank 0
checkpoints the weights the engine serves). Without ``digest`` the stream copies nothing.

With a tensor-parallel rollout engine (``tp``: the replica's ``TensorParallel``) the source
may yield this rank's rollout slices only (``nemo_tlt.weights.rollout``; the megatron
policy's slice-only reshard): the drafter's view is replicated and whole, so a slice of a
tensor it holds (the embedding, the LM head) is gathered over the replica for it (a
collective: every member streams the same names in the same order), and ``hexdigest()``
digests the replica's digests in TP rank order, so every member reports the same value and
replicas compare as whole models.
"""
from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from nemo_tlt.drafter.target_view import TargetView

if TYPE_CHECKING:
    from nemo_tlt.model.tensor_parallel import TensorParallel


class WeightStream:
    def __init__(self, source: Iterable[tuple[str, torch.Tensor]], keep: bool = False,
                 view: TargetView | None = None, tp: "TensorParallel | None" = None, digest: bool = True) -> None:
        self.source, self.keep, self.view = source, keep, view
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.kept: dict[str, torch.Tensor] = {}
        self._hash = hashlib.sha256() if digest else None
        self.digest_s = 0.0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            self._update(tensor)
            if self.view is not None:
                self.view.update(name, self._whole_for_view(name, tensor))
            if self.keep:
                self.kept[name] = tensor
            yield name, tensor

    def _whole_for_view(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` whole for the view: a vocab-row slice of a tensor the view holds is gathered."""
        if self.tp is None or name not in self.view.names:
            return tensor
        rows = self.view.get_parameter(name).shape[0]
        if tensor.shape[0] == rows:
            return tensor
        return self.tp.gather_vocab(tensor.t(), rows).t()

    def _update(self, tensor: torch.Tensor) -> None:
        if self._hash is not None:
            t0 = time.perf_counter()
            self._hash.update(_bytes(tensor))
            self.digest_s += time.perf_counter() - t0

    def add(self, module: torch.nn.Module) -> None:
        """Hash another module's weights into the digest (e.g. the drafter's)."""
        for t in module.state_dict().values():
            self._update(t)

    def hexdigest(self) -> str | None:
        """The digest so far (with ``tp``: of the replica's digests; collective over the
        replica); None without ``digest``."""
        if self._hash is None:
            return None
        mine = self._hash.hexdigest()[:16]
        if self.tp is None:
            return mine
        parts = self.tp.gather_int(int(mine[:15], 16))
        return hashlib.sha256(",".join(map(str, parts)).encode()).hexdigest()[:16]


def _bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, for any dtype (numpy has no bfloat16), read from a private host
    copy: ``numpy()`` of the tensor's own storage would mark it not resizable for good, and the
    policy's training-state offload (``rollout.training_state=offload``) releases it by resizing."""
    return tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def stream_tp(engine: Any, tp: "TensorParallel | None") -> int:
    """The ``rollout_tp`` a policy's canonical stream is asked for: the replica's TP size where the
    engine takes this rank's rollout slices (``accepts_rollout_slices``: the torch engine), else 1
    (whole tensors, the contract's default: vLLM's workers cut their own shards)."""
    return tp.size if tp is not None and getattr(engine, "accepts_rollout_slices", False) else 1


def sync_weights(policy: Any, engine: Any, drafter: Any, sd_policy: Any, idle: Any, *,
                 tp: "TensorParallel | None", keep: bool, digest: bool) -> tuple[WeightStream, str | None]:
    """One step's weight sync: the policy's canonical weights (``tp``: the rollout replica's
    ``TensorParallel``, None for one rank; at TP > 1 a model-parallel policy may send only this
    rank's slices) to the engine and the drafter's view, then the drafter (an ``IdleDrafter``, or
    None; its ``served()`` module, in ``drafter.serve_dtype``) to the engine, timed into
    ``idle.drafter_sync_s`` (the SD policy is told when the drafter trained). Returns the
    stream (its ``kept`` weights, ``hexdigest()`` of policy and drafter, ``digest_s``) and the
    policy's digest alone (None without ``digest``)."""
    stream = WeightStream(policy.canonical_weights(rollout_tp=stream_tp(engine, tp)), keep=keep,
                          view=drafter.view if drafter is not None else None, tp=tp, digest=digest)
    engine.load_policy_weights(stream)
    policy_digest = stream.hexdigest()
    if drafter is not None:
        t0 = time.perf_counter()
        engine.load_drafter(drafter.served())  # in drafter.serve_dtype; the digest is of the fp32 masters
        idle.drafter_sync_s = time.perf_counter() - t0
        if idle.drafter_steps and sd_policy is not None:
            sd_policy.drafter_updated()  # it discounts what it measured of the old drafter
        stream.add(drafter.drafter)
    return stream, policy_digest
