"""One factory from config to a rollout engine (the loop never names an engine class)."""
from __future__ import annotations

from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.protocol import RolloutEngine


def build_rollout_engine(config: RolloutConfig, model_dir: str) -> RolloutEngine:
    """The engine ``config.engine`` serving the HF-format model in ``model_dir``."""
    if config.engine == "torch":
        from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
        return TorchRolloutEngine.from_hf_folder(model_dir)
    raise ValueError(f"rollout.engine={config.engine!r} has no factory")  # RolloutConfig refuses it first
