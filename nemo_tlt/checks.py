"""Field checks for typed configs, validated at construction.

One message shape everywhere: ``<Owner>.<field> must be <what>, got <value>``, so a
bad value in a YAML file, on the command line or in code names the field and says
what was expected. Booleans are refused where numbers are expected.
"""
from __future__ import annotations

import numbers
from typing import Any


def check_int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    """An int in [lo, hi] (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{key} must be {bounds}, got {value!r}")


def check_float(key: str, value: Any, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """A real number above lo (strictly if lo_open) and below hi (strictly if hi_open)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:  # NaN: no bound holds
        raise ValueError(f"{key} must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ValueError(f"{key} must be {'<' if hi_open else '<='} {hi}, got {value!r}")
