"""Capture hidden states of the policy's log-prob / update forward pass.

Contract: ``HiddenCapture(model, callback)`` registers a forward hook on the
final norm of a megatron-core ``GPTModel`` (``decoder.final_layernorm``, which
exists only on the last pipeline stage). Every forward through that norm calls
``callback(hidden)`` with ``hidden`` shaped ``[B, T, H]`` (batch first, detached,
full sequence even under sequence parallelism). On other pipeline stages the
capture is inactive (``active`` is False) and the callback is never called.
Use as a context manager or call ``remove()``; the hook is gone afterwards.

``LayerCapture(model, layers, callback)`` does the same for the outputs of decoder
layers (the residual stream after the layer, before the final norm): ``layers`` are
0-based *global* layer indices; it hooks those this stage holds (``owned``, sorted)
and calls ``callback(layer, hidden)`` with ``hidden`` ``[B, T, H]`` (batch first, a
detached copy, gathered under sequence parallelism) once per forward through that layer.
Layers held by other stages are simply not seen here: bringing them together is the
caller's job (it knows the pipeline groups).

Why: the drafter is trained on (token, hidden state) pairs -- the final state, or
for EAGLE-3 a few layers' outputs and the final state. The log-prob forward computes
those anyway, so grabbing them there makes drafter training data cost no extra
forward pass. Pairing the hidden states with their tokens is the caller's job (it
owns the micro-batch being run).

Megatron facts relied on: ``TransformerLayer.layer_number`` is 1-based and global
(the stage's layer offset included); a layer's forward returns ``(hidden, context)``
with ``hidden`` sequence-first ``[T, B, H]`` (``[T / tp, B, H]`` under sequence
parallelism).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

HiddenCallback = Callable[[torch.Tensor], None]
LayerCallback = Callable[[int, torch.Tensor], None]  # (0-based global layer, hidden [B, T, H])


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``TransformerBlock`` of a GPTModel, unwrapping DDP / Float16Module wrappers."""
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    return getattr(inner, "decoder", None)


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The final norm of a GPTModel (unwrapping DDP / Float16Module wrappers), or None off the last stage."""
    decoder = _decoder(model)
    return getattr(decoder, "final_layernorm", None) if decoder is not None else None


def decoder_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """This stage's decoder layers by 0-based global index."""
    decoder = _decoder(model)
    if decoder is None:
        raise ValueError(f"decoder_layers: {type(model).__name__} has no megatron-core decoder (GPTModel.decoder)")
    return {layer.layer_number - 1: layer for layer in decoder.layers}


def _sequence_parallel(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "sequence_parallel", False))


def _batch_first(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """A detached sequence-first ``[T(/tp), B, H]`` activation as a full ``[B, T, H]``."""
    hidden = hidden.detach()
    if sequence_parallel:
        # Under sequence parallelism each TP rank holds a slice of the sequence dimension.
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    # Megatron runs sequence-first [T, B, H]; consumers want batch-first. Always a copy
    # (contiguous() would alias at B = 1): what the hook hands on must not change when
    # megatron reuses or updates an activation buffer in place later in the forward.
    return hidden.transpose(0, 1).clone(memory_format=torch.contiguous_format)


class HiddenCapture:
    def __init__(self, model: torch.nn.Module, callback: HiddenCallback) -> None:
        self._callback = callback
        self._sequence_parallel = _sequence_parallel(model)
        norm = final_norm(model)
        self._handle = norm.register_forward_hook(self._hook) if norm is not None else None

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._callback(_batch_first(output, self._sequence_parallel))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> "HiddenCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class LayerCapture:
    def __init__(self, model: torch.nn.Module, layers: Iterable[int], callback: LayerCallback) -> None:
        self._callback = callback
        self._sequence_parallel = _sequence_parallel(model)
        held = decoder_layers(model)
        self.owned: tuple[int, ...] = tuple(sorted(set(layers) & set(held)))
        self._handles = [held[i].register_forward_hook(self._hook_for(i)) for i in self.owned]

    def _hook_for(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, inputs: tuple, output: tuple | torch.Tensor) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            self._callback(index, _batch_first(hidden, self._sequence_parallel))
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "LayerCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
