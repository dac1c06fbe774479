"""``ALGORITHMS``: the RL algorithms by name (``algorithm``: a built-in name, a registered one,
or an import path ``package.module:factory``), and ``build_algorithm``, which builds one from
its options (``algorithm_options``, the factory's keyword arguments) and checks it on a group of
the run's size before any worker starts."""
from __future__ import annotations

from typing import Any, Mapping

from nemo_tlt.algorithms.protocol import Outcomes, RLAlgorithm
from nemo_tlt.registry import Registry

ALGORITHMS = Registry("RL algorithm", "algorithm", {
    "grpo": "nemo_tlt.algorithms.grpo:GRPO",
    "dapo": "nemo_tlt.algorithms.dapo:DAPO",
    "rloo": "nemo_tlt.algorithms.rloo:RLOO",
})


def build_algorithm(name: str, options: Mapping[str, Any] | None = None) -> RLAlgorithm:
    """``ALGORITHMS.get(name)(**options)``; a factory that refuses the options, or returns what is
    not an ``RLAlgorithm``, is a ValueError naming ``algorithm_options`` / ``algorithm``."""
    factory = ALGORITHMS.get(name)
    try:
        algorithm = factory(**dict(options or {}))
    except TypeError as err:
        raise ValueError(f"algorithm_options: the {name!r} algorithm does not take {dict(options or {})}: "
                         f"{err}") from None
    if not isinstance(algorithm, RLAlgorithm):
        raise ValueError(f"algorithm={name!r} built a {type(algorithm).__name__}, which lacks the RLAlgorithm "
                         "methods advantages(outcomes) and policy_loss(...)")
    return algorithm


def check_algorithm(name: str, options: Mapping[str, Any], group_size: int, max_new_tokens: int) -> None:
    """Build the algorithm and run its advantages on one group of the run's shape (an
    algorithm that cannot use ``group_size`` says so now, not at the first step)."""
    algorithm = build_algorithm(name, options)
    G = group_size
    algorithm.advantages(Outcomes.of([0.0] * G, [[0]] * G, G, max_new_tokens, eos_id=0))
