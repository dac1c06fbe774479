"""Parts defined outside the package and named by import path from a config only (no edit of
nemo_tlt): tests/rl/test_extension_points.py runs the demo loop with them."""
from __future__ import annotations

import os

from nemo_tlt.rollout.torch_engine import TorchRolloutEngine


class CountingEngine(TorchRolloutEngine):
    """The embedded engine, writing one line per ``generate`` to ``$TOY_ENGINE_LOG``."""

    def generate(self, requests, sampling, **kwargs):
        with open(os.environ["TOY_ENGINE_LOG"], "a") as log:
            log.write(f"{os.getpid()} {len(requests)}\n")
        return super().generate(requests, sampling, **kwargs)


def counting_engine(config, model_dir, placement, *, tp=None, drafter=None, max_batch=None):
    """A rollout-engine factory (``rollout.engine: toy_parts:counting_engine``)."""
    return CountingEngine.from_hf_folder(model_dir, device=placement.device, dtype=placement.dtype, tp=tp,
                                         compute_dtype=config.engine_compute_dtype)
