"""One factory from config to a rollout engine (the loop never names an engine class):
``build_rollout_engine`` calls the factory ``rollout.engine`` names in the engine registry
(``rollout.config.ENGINES``: the built-in ones below, any registered one, or an import path)."""
from __future__ import annotations

import logging
import tempfile

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.device import Placement
from nemo_tlt.drafter.base import Drafter
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.rollout.config import ENGINES, RolloutConfig
from nemo_tlt.rollout.protocol import RolloutEngine

log = logging.getLogger(__name__)


def engine_tensor_parallel(config: RolloutConfig) -> int:
    """The tensor-parallel size of the engine the factory builds: ``rollout.tensor_parallel`` (the
    torch engine, or vLLM's TP workers, over a replica of that many consecutive ranks), or for
    TensorRT-LLM the TP of its own workers, ``rollout.trtllm.tensor_parallel_size`` (``nemo-tlt train`` runs 1:
    ``rollout.trtllm_run``). ``nemo-tlt plan`` refuses a plan whose rollout TP differs."""
    return config.trtllm.tensor_parallel_size if config.engine == "trtllm" else config.tensor_parallel


def build_rollout_engine(config: RolloutConfig, model_dir: str, placement: Placement = Placement(),
                         tp: TensorParallel | None = None, *, drafter: Drafter | None = None,
                         max_batch: int | None = None, policy: SpecPolicy | None = None) -> RolloutEngine:
    """The engine ``config.engine`` serving the HF-format model in ``model_dir``, in
    ``placement``'s dtype on its device (the torch engine computes in ``rollout.compute_dtype``).
    ``tp`` (size > 1): this rank's place in its rollout replica's tensor-parallel group; the
    torch engine then holds and reads only its slices (every rank of the group builds one).
    ``drafter``: the drafter the engine will serve, for an engine that must be built with one
    (vLLM; the others load it with ``load_drafter``). ``max_batch``: the most requests one
    ``generate`` gets (vLLM's ``max_num_seqs`` unless ``rollout.vllm.max_num_seqs`` is set).
    ``policy``: the SD policy that will drive the engine, for an engine that fixes its draft
    schedule when built (TensorRT-LLM: the policy's state now); the others take it per call."""
    factory = ENGINES.get(config.engine)
    return factory(config, model_dir, placement, tp=tp, drafter=drafter, max_batch=max_batch, policy=policy)


def torch_engine(config: RolloutConfig, model_dir: str, placement: Placement, *, tp: TensorParallel | None = None,
                 drafter: Drafter | None = None, max_batch: int | None = None,
                 policy: SpecPolicy | None = None) -> RolloutEngine:
    """The embedded engine (``rollout.engine=torch``); it loads the drafter later (``load_drafter``)."""
    from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
    return TorchRolloutEngine.from_hf_folder(model_dir, device=placement.device, dtype=placement.dtype,
                                             tp=tp, compute_dtype=config.engine_compute_dtype,
                                             kv_cache_gib=config.kv_cache_gib,
                                             kv_cache_fraction=config.kv_cache_fraction)


def trtllm_engine(config: RolloutConfig, model_dir: str, placement: Placement, *, tp: TensorParallel | None = None,
                  drafter: Drafter | None = None, max_batch: int | None = None,
                  policy: SpecPolicy | None = None) -> RolloutEngine:
    """TensorRT-LLM (``rollout.engine=trtllm``, settings ``rollout.trtllm``): see `_trtllm_engine`.
    A torch ``drafter`` is not what it serves (its drafter is ``rollout.trtllm.drafter_dir``)."""
    if tp is not None and tp.size > 1:
        raise ValueError("rollout.tensor_parallel > 1 with rollout.engine=trtllm is not built (TensorRT-LLM "
                         "places its own TP workers; the loop's replica ranks would have to hand it their GPUs)")
    if drafter is not None:
        raise ValueError("rollout.engine=trtllm drafts with an EAGLE-3 HF folder fixed when it is built "
                         "(rollout.trtllm.drafter_dir), not a torch drafter module")
    return _trtllm_engine(config, model_dir, placement, policy)


def vllm_engine(config: RolloutConfig, model_dir: str, placement: Placement, *, tp: TensorParallel | None = None,
                drafter: Drafter | None = None, max_batch: int | None = None,
                policy: SpecPolicy | None = None) -> RolloutEngine:
    """vLLM in this process (``rollout.engine=vllm``): see `_vllm_engine`."""
    return _vllm_engine(config, model_dir, placement, drafter, max_batch, tp)


def _trtllm_engine(config: RolloutConfig, model_dir: str, placement: Placement,
                   policy: SpecPolicy | None) -> RolloutEngine:
    """TensorRT-LLM's LLM API serving ``model_dir``, built with ``policy``'s draft-length schedule
    (its state now: TensorRT-LLM runs it unchanged, see rollout.trtllm_engine) and
    ``rollout.trtllm.drafter_dir``, or without a drafter where there is none or the policy never
    speculates. TensorRT-LLM places its own workers on the node's GPUs and takes the dtype
    from the folder's config."""
    if placement.device.type != "cuda":
        raise ValueError(f"rollout.engine=trtllm runs on CUDA devices only; this rank is placed on {placement.device}")
    from nemo_tlt.rollout.trtllm_config import TRTLLMEngineConfig
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine  # lazy: optional package
    from nemo_tlt.rollout.trtllm_schedule import build_settings, draft_len_schedule
    t = config.trtllm
    drafter_dir, schedule = t.drafter_dir, {}
    if drafter_dir is not None and draft_len_schedule(policy, t.max_draft_len, t.max_batch_size):
        schedule = build_settings(policy, t.max_draft_len, t.max_batch_size)
    elif drafter_dir is not None:
        log.warning("rollout.trtllm.drafter_dir %s is not loaded: the SD policy never speculates; "
                    "TensorRT-LLM is built for plain decoding", drafter_dir)
        drafter_dir = None
    return TRTLLMRolloutEngine(TRTLLMEngineConfig(
        target_dir=model_dir, drafter_dir=drafter_dir, max_draft_len=schedule.get("max_draft_len", t.max_draft_len),
        draft_len_schedule=schedule.get("draft_len_schedule"), use_rejection_sampling=t.use_rejection_sampling,
        tensor_parallel_size=t.tensor_parallel_size, max_batch_size=t.max_batch_size,
        load_format="dummy" if t.dummy_load and drafter_dir is None else "auto"), draft_len_ceiling=t.max_draft_len)


def _vllm_engine(config: RolloutConfig, model_dir: str, placement: Placement, drafter: Drafter | None,
                 max_batch: int | None, tp: TensorParallel | None) -> RolloutEngine:
    """vLLM in this process serving ``model_dir``, built with ``drafter`` (exported to a
    temporary EAGLE-3 HF folder, which vLLM reads at start-up) when one is given; chains up to
    the SD policy's deepest arm. ``tp`` (size > 1): this rank is one of the replica's vLLM TP
    workers (vLLM's ``external_launcher``; the replica is consecutive ranks, as vLLM groups
    them). On CUDA the worker takes this rank's device: at TP 1 it must be ``cuda:0`` (one
    GPU per rank, made visible as device 0); under ``external_launcher`` vLLM's worker takes
    ``cuda:<index>`` of the rank's placement (written for CUDA, not run)."""
    tp_size = tp.size if tp is not None else 1
    if placement.device.type == "cuda" and tp_size == 1 and (placement.device.index or 0) != 0:
        raise ValueError(f"rollout.engine=vllm: this rank is placed on {placement.device}, but vLLM's in-process "
                         "worker uses cuda:0; give each rank one GPU (CUDA_VISIBLE_DEVICES) so that it is cuda:0")
    from nemo_tlt.rollout.vllm_config import VLLMEngineConfig
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine  # lazy: optional package
    settings = config.vllm
    kwargs = dict(target_dir=model_dir, num_speculative_tokens=config.max_draft_depth(),
                  max_num_seqs=settings.max_num_seqs or max_batch or 256, kv_cache_gib=settings.kv_cache_gib,
                  gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
                  enable_sleep_mode=settings.enable_sleep_mode, dtype=str(placement.dtype).removeprefix("torch."))
    if tp_size > 1:
        kwargs.update(tensor_parallel_size=tp_size, external_launcher=True,
                      local_rank=placement.device.index if placement.device.type == "cuda" else None)
    if drafter is None:
        return _same_replica(VLLMRolloutEngine(VLLMEngineConfig(**kwargs)), tp)
    from nemo_tlt.drafter.eagle3 import Eagle3Drafter
    from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"rollout.engine=vllm serves EAGLE-3 drafters; the run's drafter is a {type(drafter).__name__} "
                         "(model.drafter_dir: train one with `nemo-tlt drafter train --type eagle3`)")
    with tempfile.TemporaryDirectory(prefix="nemo_tlt_vllm_drafter_") as folder:
        write_eagle3_hf(drafter, folder)
        return _same_replica(VLLMRolloutEngine(VLLMEngineConfig(**kwargs, drafter_dir=folder)), tp)


def _same_replica(engine: RolloutEngine, tp: TensorParallel | None) -> RolloutEngine:
    """``engine`` when vLLM's TP group is the replica ``tp`` (the same global ranks, in order)."""
    built = getattr(engine, "tp", None)
    if tp is None or tp.size == 1 or built is None:
        return engine
    theirs = [built.global_rank(r) for r in range(built.size)]
    ours = [tp.global_rank(r) for r in range(tp.size)]
    if theirs != ours:
        raise ValueError(f"rollout.engine=vllm: vLLM grouped global ranks {theirs} into this rank's TP group, the "
                         f"loop's rollout replica is {ours}")
    return engine
