"""Everything of nemo-tlt that imports megatron-core, in one place.

gpt_builder       -- a megatron-core ``GPTModel`` from our ``LMConfig`` at a given TP/PP
parallel          -- megatron's parallel state on an initialised process group; device context
pipeline_forward  -- forward-only pass through megatron's pipeline schedule; the causal mask
live              -- live GPTModel shards <-> canonical weights (inside a process group)
torch_dist        -- megatron ``torch_dist`` checkpoints <-> canonical weights

megatron-core is imported lazily inside functions, so this package imports without it;
``require_megatron_core`` turns its absence into one clear error. Runtime patches applied
to megatron-core (CPU shims, hidden-state capture) live in the top-level
``megatron_patches`` package, which imports nothing of nemo_tlt.
"""
import importlib.util


def require_megatron_core(command: str) -> None:
    """Raise RuntimeError naming ``command`` and the install step when megatron-core is
    missing, before any process is spawned (a child's bare ModuleNotFoundError says neither)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise RuntimeError(f"{command} needs megatron-core, which is not installed; install it with "
                           "pip install -e \".[megatron]\" (or pip install megatron-core)")
