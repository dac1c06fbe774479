"""One factory from config to a rollout engine (the loop never names an engine class)."""
from __future__ import annotations

from nemo_tlt.dist.device import Placement
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.protocol import RolloutEngine


def build_rollout_engine(config: RolloutConfig, model_dir: str, placement: Placement = Placement()) -> RolloutEngine:
    """The engine ``config.engine`` serving the HF-format model in ``model_dir``, in
    ``placement``'s dtype on its device."""
    if config.engine == "torch":
        from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
        return TorchRolloutEngine.from_hf_folder(model_dir, device=placement.device, dtype=placement.dtype)
    raise ValueError(f"rollout.engine={config.engine!r} has no factory")  # RolloutConfig refuses it first
