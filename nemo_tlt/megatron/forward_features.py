"""The drafter's features of one forward through a pipelined ``GPTModel``, on every rank of its pipeline.

Contract: ``ForwardFeatures(model, layout, num_layers, capture_layers)`` hooks the model
for the forward(s) run while it is open: the final norm (``HiddenCapture``, last stage)
and, with ``capture_layers`` (0-based global decoder layers, in order, repeats allowed),
those layers' outputs on the stage that holds each (``LayerCapture``). After the forward,
``features(shape, device)`` (``shape = (B, T, H)``), called by every rank of this rank's pipeline
group (a collective when PP > 1), returns the same float ``[B, T, H]`` on every one of
them: the final hidden state; or with ``capture_layers`` ``[B, T, (k + 1) * H]``, the
captured layers in ``capture_layers`` order, then the final state (the EAGLE-3 layout,
nemo_tlt.drafter.features). Each captured layer is broadcast from the stage owning it
(``ParallelLayout.stage_layer_offsets``: the split the weights were loaded by, checked
against the hooked layers' own numbers), the final state from the last stage. Only the
most recent forward of each hook counts. ``close()`` removes the hooks.

Why here and not in ``megatron_patches``: the hooks are patches on megatron-core
modules and live there; putting a stage's captures together needs this rank's
pipeline group and our ``ParallelLayout``, which ``megatron_patches`` does not import.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_tlt.drafter.features import join_features
from nemo_tlt.weights.layout import ParallelLayout


def layer_stages(layout: ParallelLayout, num_layers: int) -> list[int]:
    """The pipeline stage holding each decoder layer (0-based global index -> stage)."""
    return [stage for stage, count in enumerate(layout.stage_layer_counts(num_layers)) for _ in range(count)]


class ForwardFeatures:
    def __init__(self, model: torch.nn.Module, layout: ParallelLayout, num_layers: int,
                 capture_layers: tuple[int, ...] | None = None) -> None:
        from megatron.core import parallel_state

        from megatron_patches.hidden_capture import HiddenCapture, LayerCapture

        self.layout, self.capture_layers = layout, tuple(capture_layers or ())
        self._stage_of = layer_stages(layout, num_layers)
        self._stage = parallel_state.get_pipeline_model_parallel_rank()
        self._final: torch.Tensor | None = None
        self._layers: dict[int, torch.Tensor] = {}
        self._norm = HiddenCapture(model, self._keep_final)
        self._taps = LayerCapture(model, self.capture_layers, self._layers.__setitem__) if self.capture_layers else None
        if self._taps is not None:
            expected = tuple(sorted({i for i in self.capture_layers if self._stage_of[i] == self._stage}))
            if self._taps.owned != expected:
                self.close()
                raise RuntimeError(f"ForwardFeatures: pipeline stage {self._stage} holds captured layers "
                                   f"{self._taps.owned}, but the layout (stage layer counts "
                                   f"{layout.stage_layer_counts(num_layers)}) puts {expected} there")

    def _keep_final(self, hidden: torch.Tensor) -> None:
        self._final = hidden

    def features(self, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
        """See the module docstring; ``shape`` is the forward's ``(B, T, H)``, ``device`` the model's."""
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group) if self.layout.pp > 1 else None
        # every stage agrees first that each owner captured its part, so a missing capture
        # raises on every rank instead of leaving the others waiting in a broadcast
        missing = [what for stage, mine, what in self._owned_parts() if stage == self._stage and mine is None]
        if ranks is not None:
            flag = torch.tensor([float(bool(missing))], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() > 0 and not missing:
                raise RuntimeError("ForwardFeatures: another pipeline stage ran no forward through its captures")
        if missing:
            raise RuntimeError(f"ForwardFeatures: stage {self._stage} ran no forward through {missing[0]}")

        def from_stage(stage: int, mine: torch.Tensor | None) -> torch.Tensor:
            if stage == self._stage:
                tensor = mine.float().contiguous()
            else:
                tensor = torch.empty(shape, dtype=torch.float32, device=device)
            if ranks is not None:
                dist.broadcast(tensor, src=ranks[stage], group=group)
            return tensor

        # every rank visits the parts in one order: the final state, then the layers sorted
        final, *captured = [from_stage(stage, mine) for stage, mine, _ in self._owned_parts()]
        layers = dict(zip(sorted(set(self.capture_layers)), captured))
        return join_features(final, [layers[i] for i in self.capture_layers])

    def _owned_parts(self) -> list[tuple[int, torch.Tensor | None, str]]:
        """(owning stage, this rank's capture or None, name) of the final state and each captured layer."""
        parts = [(self.layout.pp - 1, self._final, "the final norm")]
        return parts + [(self._stage_of[i], self._layers.get(i), f"decoder layer {i}")
                        for i in sorted(set(self.capture_layers))]

    def close(self) -> None:
        self._norm.remove()
        if self._taps is not None:
            self._taps.remove()
