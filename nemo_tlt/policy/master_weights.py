"""fp32 master weights for a model whose parameters are bf16 (mixed-precision training).

Contract
--------
``MasterWeights(params)`` over a model's trainable parameters:

* fp32 parameters: the masters *are* the parameters (no copy, no cost; every method below
  is a no-op), so an fp32 run computes exactly as without this class.
* Otherwise it keeps one fp32 copy of each parameter (``masters``, 4 bytes per weight on
  the parameters' device) carrying the parameter's Python attributes (megatron's
  ``tensor_model_parallel``, ``shared``, ...), so code that inspects them sees the same.
  ``zero_grads()`` starts a step. With ``fp32_accumulation`` (the default) a hook on each
  bf16 parameter adds every backward's gradient into its master's fp32 ``grad`` as soon
  as autograd has it and frees the bf16 one, so the micro-batches of a step sum in fp32
  (megatron-core's ``main_grad``); ``grads_to_masters()`` then adds any gradient left on
  a parameter (one set by hand). The gradient reduction, the clip and the optimizer run
  in fp32 over ``masters``; after the optimizer step, ``masters_to_params()`` rounds the
  masters back into the parameters (round to nearest even, as ``Tensor.copy_`` casts).
  Without ``fp32_accumulation`` the bf16 ``grad`` of every micro-batch accumulates in
  bf16 and ``grads_to_masters()`` casts the sum (for a caller that edits parameter
  gradients between backward and the step, e.g. a tied-embedding sum over ranks).
* The optimizer is built over ``masters`` (so its state is fp32), ``state_dict()`` /
  ``load_state_dict()`` carry the fp32 masters (a resumed run continues from the same
  fp32 values, not from their bf16 rounding), and ``params_to_masters()`` refreshes the
  masters after the parameters were replaced from outside (``load_canonical``).

This is the scheme of megatron-core's ``Float16OptimizerWithFloat16Params`` (and of the
distributed optimizer, unsharded), written for the backends' own AdamW: the torch
backend has no megatron, and the megatron backend's optimizer is not megatron's (yet).
"""
from __future__ import annotations

from typing import Sequence

import torch


class MasterWeights:
    def __init__(self, params: Sequence[torch.nn.Parameter], fp32_accumulation: bool = True) -> None:
        self.params = list(params)
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.fp32_accumulation = fp32_accumulation and self.mixed
        if not self.mixed:
            self.masters = self.params
            return
        self.masters = []
        for p in self.params:
            master = torch.nn.Parameter(p.detach().float().clone(), requires_grad=True)
            master.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
            master.grad = torch.zeros_like(master)
            self.masters.append(master)
            if self.fp32_accumulation:
                p.register_post_accumulate_grad_hook(_into_master(master))

    @torch.no_grad()
    def zero_grads(self, set_to_none: bool = False) -> None:
        """Start a step: zeros on the masters (fp32 parameters: their existing gradients
        zeroed in place, as ``zero_grad(set_to_none=False)``; with ``set_to_none``, dropped,
        so the next backward hands each its gradient without adding it to zeros), none on
        bf16 parameters."""
        for p in self.params:
            if not self.mixed:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            else:
                p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad.zero_()

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Gradients still on the parameters into the masters' fp32 grads (added with
        fp32 accumulation, copied without; a missing one counts as zeros)."""
        if not self.mixed:
            return
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                if not self.fp32_accumulation:
                    m.grad.zero_()
            elif self.fp32_accumulation:
                m.grad.add_(p.grad)
                p.grad = None
            else:
                m.grad.copy_(p.grad)

    @torch.no_grad()
    def masters_to_params(self) -> None:
        if self.mixed:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    @torch.no_grad()
    def params_to_masters(self) -> None:
        if self.mixed:
            for p, m in zip(self.params, self.masters):
                m.copy_(p)

    def state_dict(self) -> list[torch.Tensor] | None:
        """The fp32 masters of a bf16 model; None for an fp32 one."""
        return [m.detach().clone() for m in self.masters] if self.mixed else None

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor] | None) -> None:
        """Restore the fp32 masters (and the parameters from them). ``state`` None is an fp32
        run's (no masters): only an fp32 model takes it; a bf16 model refuses it, and an fp32
        model refuses masters, since either way the run would not continue exactly."""
        if self.mixed != (state is not None):
            have, got = ("bfloat16", "fp32 (no master weights)") if self.mixed else ("float32", "bf16 (master weights)")
            raise ValueError(f"policy state: this model.dtype={have} run cannot continue a checkpoint of a {got} run "
                             "exactly; resume with the model.dtype it was written with")
        if state is None:
            self.params_to_masters()
            return
        if len(state) != len(self.masters):
            raise ValueError(f"MasterWeights.load_state_dict: {len(state)} master tensors for "
                             f"{len(self.masters)} parameters")
        for m, saved in zip(self.masters, state):
            if tuple(saved.shape) != tuple(m.shape):
                raise ValueError(f"MasterWeights.load_state_dict: a master of shape {tuple(saved.shape)} for a "
                                 f"parameter of shape {tuple(m.shape)}")
            m.copy_(saved)
        self.masters_to_params()


def _into_master(master: torch.nn.Parameter):
    """The post-accumulate hook of one bf16 parameter: its gradient into the master's, in fp32."""
    @torch.no_grad()
    def hook(param: torch.Tensor) -> None:
        master.grad.add_(param.grad)
        param.grad = None
    return hook
