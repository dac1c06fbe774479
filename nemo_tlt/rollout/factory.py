"""One factory from config to a rollout engine (the loop never names an engine class)."""
from __future__ import annotations

from nemo_tlt.device import Placement
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.protocol import RolloutEngine


def engine_tensor_parallel(config: RolloutConfig) -> int:
    """The tensor-parallel size of the engine the loop builds: ``rollout.tensor_parallel`` (the
    torch engine over a replica of that many consecutive ranks; the TensorRT-LLM engine only at
    1, ``RolloutConfig`` refuses more). ``nemo-tlt plan`` refuses a plan whose rollout TP differs."""
    return config.tensor_parallel


def build_rollout_engine(config: RolloutConfig, model_dir: str, placement: Placement = Placement(),
                         tp: TensorParallel | None = None) -> RolloutEngine:
    """The engine ``config.engine`` serving the HF-format model in ``model_dir``, in
    ``placement``'s dtype on its device (the torch engine computes in ``rollout.compute_dtype``).
    ``tp`` (size > 1): this rank's place in its rollout replica's tensor-parallel group; the
    torch engine then holds and reads only its slices (every rank of the group builds one)."""
    if config.engine == "torch":
        from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
        return TorchRolloutEngine.from_hf_folder(model_dir, device=placement.device, dtype=placement.dtype,
                                                 tp=tp, compute_dtype=config.engine_compute_dtype)
    if config.engine == "trtllm":
        if tp is not None and tp.size > 1:
            raise ValueError("rollout.tensor_parallel > 1 with rollout.engine=trtllm is not built (TensorRT-LLM "
                             "places its own TP workers; the loop's replica ranks would have to hand it their GPUs)")
        return _trtllm_engine(model_dir, placement, engine_tensor_parallel(config))
    raise ValueError(f"rollout.engine={config.engine!r} has no factory")  # RolloutConfig refuses it first


def _trtllm_engine(model_dir: str, placement: Placement, tensor_parallel: int) -> RolloutEngine:
    """TensorRT-LLM's LLM API serving ``model_dir`` without a drafter (a drafter is an
    EAGLE-3 folder fixed at build time: ``rollout.trtllm_run``). TensorRT-LLM places its
    own workers on the node's GPUs and takes the dtype from the folder's config."""
    if placement.device.type != "cuda":
        raise ValueError(f"rollout.engine=trtllm runs on CUDA devices only; this rank is placed on {placement.device}")
    from nemo_tlt.rollout.trtllm_config import TRTLLMEngineConfig
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine  # lazy: optional package
    return TRTLLMRolloutEngine(TRTLLMEngineConfig(target_dir=model_dir, tensor_parallel_size=tensor_parallel))
