"""Runtime patches and helpers applied to megatron-core, only when asked.

* ``cpu_shims``: run real megatron-core on CPU with gloo (tests, laptops); refused on GPUs.
* ``gpt_builder``: a megatron-core ``GPTModel`` from our ``LMConfig`` at a given TP/PP.
* ``pipeline_forward``: forward-only pass through megatron's pipeline schedule.
* ``hidden_capture``: final-norm hook that hands the policy's hidden states to a callback.
* ``gloo_launch``: spawn N CPU processes joined by a gloo group.

Nothing is patched on import.
"""

import importlib.util


def require_megatron_core(command: str) -> None:
    """Raise RuntimeError naming ``command`` and the install step when megatron-core is
    missing, before any process is spawned (a child's bare ModuleNotFoundError says neither)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise RuntimeError(f"{command} needs megatron-core, which is not installed; install it with "
                           "pip install -e \".[megatron]\" (or pip install megatron-core)")
