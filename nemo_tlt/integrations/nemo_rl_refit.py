"""NeMo-RL's colocated weight refit (CUDA IPC over ZMQ), the receiving side.

Followed at ``interface_facts.NEMO_RL_SOURCE`` (``nemo_rl/models/policy/utils.py``
``stream_weights_via_ipc_zmq_impl`` sends; ``nemo_rl/models/generation/vllm/vllm_backend.py``
and ``trtllm/trtllm_backend.py`` ``update_weights_via_ipc_zmq`` receive):

* the training rank binds a ZMQ REQ socket at ``ipc:///tmp/<GPU UUID>.sock`` (the NVML UUID of
  the GPU it shares with the generation worker); the receiver connects a REP socket there;
  both set 120 s send / receive timeouts and ``LINGER=0``;
* each message is a pickled ``(handle, names, used_bytes)``: ``handle`` = ``reduce_tensor(buffer)[1:]``
  of one uint8 buffer holding the named tensors' raw bytes, each at a 512-byte aligned offset,
  in ``names`` order; shapes and dtypes are not sent (they come from ``prepare_refit_info``);
  the receiver answers each message with the raw bytes ``b"ack"``;
* the sender reuses a buffer once the next group is acknowledged (two ping-pong buffers), so
  the views are copied before the acknowledgement here;
* the last message is the pickled ``IPCProtocol.COMPLETE`` (an Enum whose value is
  ``"complete"``), answered with ``b"ack"`` too.

Pure protocol: the socket, the handle rebuild (CUDA: ``rebuild_cuda_tensor`` with the local
device) and what consumes the tensors are the caller's.
"""
from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

ALIGNMENT = 512
ACK = b"ack"
COMPLETE = "complete"
TIMEOUT_MS = 120_000
_PROTOCOL_CLASS = ("nemo_rl.models.policy.utils", "IPCProtocol")


def aligned_size(nbytes: int) -> int:
    """``calculate_aligned_size``: ``nbytes`` rounded up to the 512-byte alignment."""
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def socket_address(device_uuid: str) -> str:
    """Where a training rank and the generation worker on GPU ``device_uuid`` meet."""
    if not isinstance(device_uuid, str) or not device_uuid or "/" in device_uuid:
        raise ValueError(f"device_uuid must be a GPU UUID string (e.g. 'GPU-...'), got {device_uuid!r}")
    return f"ipc:///tmp/{device_uuid}.sock"


class _Complete:
    """Stands for ``IPCProtocol.COMPLETE`` when it is unpickled without NeMo-RL."""

    def __init__(self, value: str) -> None:
        self.value = value


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _PROTOCOL_CLASS:
            return _Complete
        return super().find_class(module, name)


def decode(message: bytes) -> tuple[Any, list[str], int] | None:
    """One message: None for the end of the stream, else ``(handle, names, used_bytes)``;
    anything else is a ValueError naming what came."""
    payload = _Unpickler(io.BytesIO(message)).load()
    if isinstance(payload, _Complete) and payload.value == COMPLETE:
        return None
    if not (isinstance(payload, tuple) and len(payload) == 3 and isinstance(payload[1], list)
            and isinstance(payload[2], int)):
        raise ValueError(f"NeMo-RL IPC refit: expected (handle, names, used_bytes) or COMPLETE, got "
                         f"{type(payload).__name__}")
    return payload


def unpack(buffer: torch.Tensor, names: list[str], used_bytes: int,
           info: Mapping[str, tuple[torch.Size, torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors as views of ``buffer`` (uint8 [N]), shapes and dtypes from
    ``info`` (``prepare_refit_info``'s map); a name not in it, or offsets that do not end at
    ``used_bytes``, is a ValueError."""
    out, offset = [], 0
    for name in names:
        if name not in info:
            raise ValueError(f"NeMo-RL IPC refit: tensor {name!r} is not in prepare_refit_info's state_dict_info")
        shape, dtype = info[name]
        size = dtype.itemsize * torch.Size(shape).numel()
        out.append((name, buffer[offset:offset + size].view(dtype).view(shape)))
        offset += aligned_size(size)
    if offset != used_bytes:
        raise ValueError(f"NeMo-RL IPC refit: the group's tensors end at byte {offset}, the sender used {used_bytes} "
                         "(state_dict_info's shapes or dtypes differ from the sender's)")
    return out


class Receiver:
    """One refit's stream of (name, tensor), each tensor a copy (the sender reuses its
    buffers once acknowledged); every message is acknowledged, a group once its tensors
    were consumed. Iterating raises a ValueError for a malformed message, a repeated name,
    or (after the final acknowledgement) a name of ``info`` that never arrived. After a
    failure on either side, `drain` acknowledges the rest so that the sender finishes
    instead of timing out. ``recv`` / ``send``: the REP socket's raw receive and send.
    Before each acknowledgement, ``synchronize(buffer)`` waits for the copies out of the
    group's buffer (on CUDA they are queued on the stream: NeMo-RL's receivers synchronise
    the current stream there too)."""

    def __init__(self, recv: Callable[[], bytes], send: Callable[[bytes], Any],
                 info: Mapping[str, tuple[torch.Size, torch.dtype]], rebuild: Callable[[Any], torch.Tensor],
                 synchronize: Callable[[torch.Tensor], None] | None = None) -> None:
        self._recv, self._send, self.info, self.rebuild = recv, send, info, rebuild
        self.synchronize = synchronize if synchronize is not None else synchronize_copies
        self.complete = False
        self._owed = False  # a message received and not yet acknowledged
        self._buffer: torch.Tensor | None = None  # the group's rebuilt buffer, until acknowledged

    def _next(self) -> tuple[Any, list[str], int] | None:
        message = self._recv()
        self._owed = True
        payload = decode(message)
        if payload is None:
            self.complete = True
        return payload

    def _ack(self) -> None:
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            self.synchronize(buffer)
        if self._owed:
            self._owed = False
            self._send(ACK)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        try:
            while (payload := self._next()) is not None:
                handle, names, used = payload
                self._buffer = self.rebuild(handle)
                for name, view in unpack(self._buffer, names, used, self.info):
                    if name in seen:
                        raise ValueError(f"NeMo-RL IPC refit: tensor {name!r} arrived twice")
                    seen.add(name)
                    yield name, view.clone()
                self._ack()
        finally:
            self._ack()
        missing = [n for n in self.info if n not in seen]
        if missing:
            raise ValueError(f"NeMo-RL IPC refit: {len(missing)} tensors of state_dict_info never arrived, "
                             f"e.g. {missing[0]!r}")

    def drain(self) -> None:
        """Acknowledge everything up to and including COMPLETE (nothing when it came); a
        message that cannot be read is acknowledged too, then its error raised."""
        try:
            self._ack()
            while not self.complete:
                self._next()
                self._ack()
        finally:
            self._ack()


def synchronize_copies(buffer: torch.Tensor) -> None:
    """Wait for the work queued on ``buffer``'s device (the clones out of it); nothing on a CPU."""
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
