"""Capture the policy's final hidden states during its log-prob forward pass.

Contract: ``HiddenCapture(model, callback)`` registers a forward hook on the
final norm of a megatron-core ``GPTModel`` (``decoder.final_layernorm``, which
exists only on the last pipeline stage). Every forward through that norm calls
``callback(hidden)`` with ``hidden`` shaped ``[B, T, H]`` (batch first, detached,
full sequence even under sequence parallelism). On other pipeline stages the
capture is inactive (``active`` is False) and the callback is never called.
Use as a context manager or call ``remove()``; the hook is gone afterwards.

Why: the drafter is trained on (token, final hidden state) pairs. The log-prob
forward computes those hidden states anyway, so grabbing them there makes
drafter training data cost no extra forward pass. Pairing the hidden states with
their tokens is the caller's job (it owns the micro-batch being run).
"""
from __future__ import annotations

from typing import Callable

import torch

HiddenCallback = Callable[[torch.Tensor], None]


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The final norm of a GPTModel (unwrapping DDP / Float16Module wrappers), or None off the last stage."""
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    decoder = getattr(inner, "decoder", None)
    return getattr(decoder, "final_layernorm", None) if decoder is not None else None


class HiddenCapture:
    def __init__(self, model: torch.nn.Module, callback: HiddenCallback) -> None:
        self._callback = callback
        self._sequence_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
        norm = final_norm(model)
        self._handle = norm.register_forward_hook(self._hook) if norm is not None else None

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        hidden = output.detach()
        if self._sequence_parallel:
            # Under sequence parallelism each TP rank holds a slice of the sequence dimension.
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        # Megatron runs sequence-first [T, B, H]; consumers want batch-first.
        self._callback(hidden.transpose(0, 1).contiguous())

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> "HiddenCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
