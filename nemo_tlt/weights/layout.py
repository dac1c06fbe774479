"""`ParallelLayout`: how a model is split by tensor (TP) and pipeline (PP) parallelism.

Pure bookkeeping, no torch.distributed: which global layers a pipeline stage
holds (Megatron numbers layers from 0 inside every stage), and how large the
vocabulary is after Megatron pads it so that every TP rank holds the same number
of rows. Uneven stages follow megatron-core's rule: the first and/or last stage
may hold a given number of layers, the remaining layers are split evenly over the
middle stages.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.checks import check_int


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "make_vocab_size_divisible_by"):
            check_int(f"ParallelLayout.{name}", getattr(self, name), 1)
        for name in ("num_layers_in_first_stage", "num_layers_in_last_stage"):
            value = getattr(self, name)
            if value is not None:
                if self.pp < 2:
                    raise ValueError(f"ParallelLayout.{name} needs pp >= 2, got pp={self.pp}")
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"ParallelLayout.{name} must be a positive int or None, got {value!r}")

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Number of transformer layers on each pipeline stage, in stage order."""
        first, last = self.num_layers_in_first_stage, self.num_layers_in_last_stage
        fixed = [s for s in (first, last) if s is not None]
        middle_stages = self.pp - len(fixed)
        rest = num_layers - sum(fixed)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages):
            raise ValueError(
                f"ParallelLayout: {num_layers} layers cannot be split over pp={self.pp} stages "
                f"(first={first}, last={last}); the layers left for the other stages must divide evenly"
            )
        per_middle = rest // middle_stages if middle_stages else 0
        counts = [per_middle] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def stage_layer_offsets(self, num_layers: int) -> list[int]:
        """Global index of the first layer of every stage."""
        offsets, acc = [], 0
        for count in self.stage_layer_counts(num_layers):
            offsets.append(acc)
            acc += count
        return offsets

    def global_layer(self, stage: int, local_layer: int, num_layers: int) -> int:
        counts = self.stage_layer_counts(num_layers)
        if not 0 <= local_layer < counts[stage]:
            raise ValueError(f"stage {stage} has {counts[stage]} layers; local layer {local_layer} is out of range")
        return self.stage_layer_offsets(num_layers)[stage] + local_layer

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Megatron's padding: round up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab_size // multiple) * multiple
