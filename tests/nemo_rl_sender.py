"""NeMo-RL's colocated refit sender, written from its source for tests (NOT NeMo-RL): the
protocol of ``stream_weights_via_ipc_zmq_impl`` (``nemo_rl/models/policy/utils.py`` at
``interface_facts.NEMO_RL_SOURCE``) with CPU buffers in place of CUDA ones.

* a REQ socket bound at ``ipc:///tmp/<uuid>.sock``, 120 s timeouts, ``LINGER=0``;
* two ping-pong uint8 buffers of ``buffer_bytes // 2`` (512-aligned) each; every tensor's raw
  bytes at a 512-byte aligned offset; a group sent as the pickled ``(reduce_tensor(buffer)[1:],
  names, used_bytes)``; before each send after the first, the previous group's ACK is awaited;
* a tensor larger than one buffer goes alone in a temporary buffer, its ACK awaited at once;
* the end: the last ACK, then the pickled ``IPCProtocol.COMPLETE`` (an Enum of module
  ``nemo_rl.models.policy.utils``, made here under that name), then the final ACK.

The handle of a CPU buffer is rebuilt with `rebuild_cpu` (upstream: ``rebuild_cuda_tensor``
on the receiver's device).
"""
from __future__ import annotations

import enum
import pickle
import sys
import threading
import types
from collections.abc import Iterable

import torch
import zmq
from torch.multiprocessing.reductions import rebuild_tensor, reduce_tensor

from nemo_tlt.integrations.nemo_rl_refit import aligned_size, socket_address

PROTOCOL_MODULE = "nemo_rl.models.policy.utils"


class IPCProtocol(enum.Enum):
    COMPLETE = "complete"
    ACK = "ack"


IPCProtocol.__module__ = PROTOCOL_MODULE


def complete_message(member: IPCProtocol = IPCProtocol.COMPLETE) -> bytes:
    """``send_pyobj(IPCProtocol.COMPLETE)``'s bytes (or another member's), pickled as NeMo-RL's own
    Enum member."""
    parts = PROTOCOL_MODULE.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    previous = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[PROTOCOL_MODULE].IPCProtocol = IPCProtocol
    try:
        return pickle.dumps(member)
    finally:
        for name, module in previous.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


def rebuild_cpu(handle) -> torch.Tensor:
    return rebuild_tensor(*handle[0])


def stream(uuid: str, tensors: Iterable[tuple[str, torch.Tensor]], buffer_bytes: int = 4096,
           names: dict[str, str] | None = None) -> None:
    """Send ``tensors`` as one refit, blocking until the receiver acknowledged COMPLETE."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    for opt, value in ((zmq.SNDTIMEO, 120_000), (zmq.RCVTIMEO, 120_000), (zmq.LINGER, 0)):
        sock.setsockopt(opt, value)
    sock.bind(socket_address(uuid))
    half = aligned_size(buffer_bytes // 2)
    buffers = [torch.empty(half, dtype=torch.uint8), torch.empty(half, dtype=torch.uint8)]
    which, used, group, sent = 0, 0, [], 0

    def send(buffer: torch.Tensor, group_names: list[str], nbytes: int) -> None:
        nonlocal sent
        if sent:
            sock.recv()  # the previous group's ACK
        sock.send(pickle.dumps((reduce_tensor(buffer.detach())[1:], group_names, nbytes)))
        sent += 1

    try:
        for name, tensor in tensors:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            size = aligned_size(raw.numel())
            if size > half:  # alone in a temporary buffer, acknowledged at once
                if group:
                    send(buffers[which], group, used)
                    which, used, group = 1 - which, 0, []
                big = torch.zeros(size, dtype=torch.uint8)
                big[:raw.numel()] = raw
                send(big, [name], size)
                sock.recv()
                sent = 0
                continue
            if used + size > half:
                send(buffers[which], group, used)
                which, used, group = 1 - which, 0, []
            buffers[which][used:used + raw.numel()] = raw
            used += size
            group.append(name)
        if group:
            send(buffers[which], group, used)
        if sent:
            sock.recv()
        sock.send(complete_message())
        sock.recv()
    finally:
        sock.close(linger=0)


def stream_in_thread(uuid: str, tensors: Iterable[tuple[str, torch.Tensor]], **kwargs) -> threading.Thread:
    """`stream` in a daemon thread; its exception, if any, lands in ``thread.error``."""
    def run() -> None:
        try:
            stream(uuid, list(tensors), **kwargs)
        except BaseException as err:  # handed to the test
            thread.error = err

    thread = threading.Thread(target=run, daemon=True)
    thread.error = None
    thread.start()
    return thread
