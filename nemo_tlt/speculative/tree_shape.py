"""`TreeShape`: the value that names a draft-tree shape.

A draft tree is grown EAGLE-2 style: `depth` drafter steps, each expanding the
`topk` best children of the `topk` best frontier nodes (ranked by cumulative draft
log-probability); of everything drafted, the best `num_verify` nodes are sent to
the target for verification in one forward pass. The bandit's arms are TreeShapes.
fastrl's string form ``"<depth>_<topk>_<num_verify>"`` (e.g. ``"8_4_32"``) is
accepted only at the config boundary, through :meth:`TreeShape.parse`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True, order=True)
class TreeShape:
    depth: int
    topk: int
    num_verify: int

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "num_verify"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TreeShape.{name} must be a positive int, got {value!r}")
        if self.num_verify > self.max_nodes:
            raise ValueError(
                f"TreeShape.num_verify={self.num_verify} is larger than the tree can hold: "
                f"depth={self.depth}, topk={self.topk} drafts at most {self.max_nodes} nodes"
            )

    @property
    def max_nodes(self) -> int:
        """Nodes drafted in all: topk at depth 1, then topk*topk candidates per further depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def name(self) -> str:
        return f"{self.depth}_{self.topk}_{self.num_verify}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str, field: str = "tree shape") -> "TreeShape":
        """Parse fastrl's ``depth_topk_numverify`` form, e.g. ``"8_4_32"``."""
        if not isinstance(text, str):
            raise ValueError(f"{field}: expected a string 'depth_topk_numverify' like '8_4_32', got {text!r}")
        parts = text.strip().split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"{field}: malformed tree shape {text!r}; expected 'depth_topk_numverify' "
                "with three positive integers, e.g. '8_4_32'"
            )
        try:
            return cls(*(int(p) for p in parts))
        except ValueError as err:
            raise ValueError(f"{field}: {text!r}: {err}") from None


def parse_arms(arms: Sequence[TreeShape | str], owner: str) -> tuple[TreeShape, ...]:
    """The arms of a shape-choosing policy as TreeShapes: strings in fastrl's form are
    parsed (the config boundary), TreeShapes (or their {depth, topk, num_verify}
    mappings) pass through; at least one, no duplicates.
    Errors name ``<owner>.arms[i]``."""
    if isinstance(arms, str) or not isinstance(arms, Sequence):
        raise ValueError(f"{owner}.arms must be a list of 'depth_topk_numverify' tree shapes, got {arms!r}")
    if not arms:
        raise ValueError(f"{owner}.arms must list at least one 'depth_topk_numverify' tree shape, got none")
    shapes: list[TreeShape] = []
    for i, arm in enumerate(arms):
        field = f"{owner}.arms[{i}]"
        if isinstance(arm, TreeShape):
            shape = arm
        elif isinstance(arm, Mapping) and set(arm) == {"depth", "topk", "num_verify"}:
            shape = TreeShape(**arm)  # the structured form a config tree round-trips through
        elif isinstance(arm, int) and not isinstance(arm, bool):
            # YAML 1.1 reads 4_2_8 as the integer 428; the shape is gone before we see it.
            raise ValueError(f"{field}={arm!r}: YAML read an unquoted arm such as 4_2_8 as a number; "
                             "quote each arm, e.g. arms: ['4_2_8', '6_2_12']")
        else:
            shape = TreeShape.parse(arm, field=field)
        if shape in shapes:
            raise ValueError(f"{field}={shape.name} duplicates arms[{shapes.index(shape)}]; arms must be unique")
        shapes.append(shape)
    return tuple(shapes)
