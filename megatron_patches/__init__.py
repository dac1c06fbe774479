"""Runtime patches applied to megatron-core, only when asked.

* ``cpu_shims``: run real megatron-core on CPU with gloo (tests, laptops); refused on GPUs.
* ``hidden_capture``: final-norm hook that hands the policy's hidden states to a callback.

Nothing is patched on import, and nothing of nemo_tlt is imported here: nemo_tlt's
megatron code (``nemo_tlt.megatron``) uses these patches, never the other way round.
"""
