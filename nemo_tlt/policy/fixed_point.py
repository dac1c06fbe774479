"""Gradients summed in fixed point: a sum whose bits do not depend on the order of its terms.

Why: the pipelined update (``policy.pipelined_update``) computes each GRPO group's gradient
whenever and wherever that group's rollouts are complete, so the order in which group
gradients are added differs from run to run (and between TLT and its baseline). Float
addition is not associative; integer addition is. Each term is rounded once to a multiple
of ``2**-FRACTION_BITS`` (as an int64), the integers are summed (in any order, on any rank,
through one all-reduce) and the exact integer total is converted back once. Two runs whose
terms are bit-identical therefore end with bit-identical gradients, whoever added what when.

Contract
--------
* A term is the gradient of a token-*sum* loss divided by ``token_budget`` (a bound on the
  step's response tokens fixed before the rollout: prompts x group size x max_new_tokens),
  so every partial sum is a weighted mean of per-token gradients with weights summing to at
  most 1. ``add(grads, tokens)`` refuses (``FloatingPointError``) a term any of whose
  elements exceeds ``tokens / token_budget * 2**(62 - FRACTION_BITS)`` in magnitude: within
  that bound no partial or total sum, on any rank or after the all-reduce, can reach
  ``2**63``. (An element of 2**18 per token is far beyond any trained model's gradient.)
* A non-finite element is not rounded: the accumulator remembers it, and after the
  reduction that tensor comes back all NaN (the clip and the optimizer then see a
  non-finite gradient, as with float accumulation).
* ``reduce()`` sums the integers over the default process group (a no-op without one),
  ``result(scale)`` returns ``total * 2**-FRACTION_BITS * scale`` per tensor in float32
  (``scale = token_budget / global_tokens`` turns the sums into the token mean).
* ``add`` has a fast path beside its plain reference (``_add_reference``, per tensor in
  float64): float32 gradients whose every element is finite and within the bound are
  copied into one flat float32 buffer, scaled, rounded and converted in one pass each.
  It adds the same integers bit for bit: scaling by ``2**FRACTION_BITS`` is exact in
  float32 as in float64 (a power of two, far from overflow within the bound), both round
  half to even the same real number, and a rounded value below 2**63 converts exactly. A
  term with a non-finite or out-of-range element takes the reference path (which counts
  or refuses it per tensor). Its cost: a flat float32 copy and an int64 one of the
  term while it is added.
* Memory: one int64 buffer per gradient, twice an fp32 gradient's bytes (flattened for
  the one all-reduce); resolution ``2**-44`` (~5.7e-14) on the scale of the step's mean
  gradient.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

FRACTION_BITS = 44
_ONE = float(2 ** FRACTION_BITS)
_LIMIT = 2.0 ** (62 - FRACTION_BITS)


class FixedPointGrads:
    """Order-independent gradient sums over tensors shaped like ``like``. See the module docstring."""

    def __init__(self, like: Sequence[torch.Tensor], token_budget: int) -> None:
        if token_budget < 1:
            raise ValueError(f"FixedPointGrads: token_budget must be >= 1, got {token_budget}")
        self.token_budget = int(token_budget)
        self.shapes = [tuple(t.shape) for t in like]
        numel = sum(t.numel() for t in like)
        device = like[0].device if like else torch.device("cpu")
        # one flat buffer (the all-reduce takes it whole); the last len(like) entries count
        # each tensor's non-finite terms
        self.flat = torch.zeros(numel + len(self.shapes), dtype=torch.int64, device=device)
        self.views = list(self.flat[:numel].split([t.numel() for t in like]))
        self.nonfinite = self.flat[numel:]

    def add(self, grads: Sequence[torch.Tensor | None], tokens: int) -> None:
        """Add one term (``None``: zeros): the gradients of ``sum(loss over tokens) / token_budget``."""
        if len(grads) != len(self.views):
            raise ValueError(f"FixedPointGrads.add: {len(grads)} gradients for {len(self.views)} tensors")
        bound = _LIMIT * max(int(tokens), 1) / self.token_budget
        present = [(k, g.detach()) for k, g in enumerate(grads) if g is not None and g.numel()]
        if not present:
            return
        if all(g.dtype == torch.float32 for _, g in present) and self._add_float32(present, bound):
            return
        self._add_reference(present, bound, tokens)

    def _add_float32(self, present: list[tuple[int, torch.Tensor]], bound: float) -> bool:
        """The fast path (module docstring): True when it added the term, False (nothing
        added) when an element is non-finite or beyond ``bound``."""
        flat = torch.cat([g.reshape(-1) for _, g in present])  # a copy: the caller's gradients stay as they are
        lo, hi = torch.stack(torch.aminmax(flat)).tolist()  # a NaN makes both NaN: the range test fails
        if not (-bound <= lo and hi <= bound):
            return False
        ints = flat.mul_(_ONE).round_().to(torch.int64)
        if len(present) == len(self.views):
            self.flat[:ints.numel()].add_(ints)
        else:
            for (k, _), chunk in zip(present, ints.split([g.numel() for _, g in present])):
                self.views[k].add_(chunk)
        return True

    def _add_reference(self, present: list[tuple[int, torch.Tensor]], bound: float, tokens: int) -> None:
        """The plain path, per tensor in float64: counts non-finite terms, refuses out-of-range ones."""
        terms = [(k, g.reshape(-1).double()) for k, g in present]
        finite = [torch.isfinite(g64) for _, g64 in terms]
        terms = [(k, torch.where(ok, g64, torch.zeros_like(g64))) for (k, g64), ok in zip(terms, finite)]
        # every tensor's peak and non-finite flag in one read back (one host sync per term)
        checks = torch.stack([torch.stack((g64.abs().max(), (~ok).any().double())) for (_, g64), ok
                              in zip(terms, finite)]).tolist()
        for (k, g64), (peak, bad) in zip(terms, checks):
            if peak > bound:
                raise FloatingPointError(
                    f"policy.pipelined_update: a gradient element of {peak:.3g} (tensor {k}, shape "
                    f"{self.shapes[k]}) from {tokens} tokens exceeds the fixed-point range {bound:.3g} "
                    f"(2**{62 - FRACTION_BITS} per token of the step's {self.token_budget}-token budget); "
                    "the run diverged, or set policy.pipelined_update=false")
            if bad:
                self.nonfinite[k] += 1
        for k, g64 in terms:
            self.views[k].add_(torch.round(g64 * _ONE).to(torch.int64))

    def reduce(self) -> None:
        """Sum the integers over the default process group (exact; a no-op without one)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.flat)

    def result(self, scale: float) -> list[torch.Tensor]:
        """Each tensor's total times ``2**-FRACTION_BITS * scale``, as float32 (NaN where a term was not finite)."""
        factor = scale / _ONE
        out = []
        for view, shape, bad in zip(self.views, self.shapes, self.nonfinite.tolist()):
            value = (view.double() * factor).float().reshape(shape)
            out.append(torch.full_like(value, float("nan")) if bad else value)
        return out
