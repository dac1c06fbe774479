"""A NeMo-Aligner-compatible generation backend with TLT behind it.

NeMo-Aligner's PPO / REINFORCE actors (``MegatronGPTActorModel``; NVIDIA/NeMo-Aligner
@af2b3bd, archived) drive TensorRT-LLM through ``GPTGenerateTRTLLM``:
``refit(model)`` before a rollout, ``generate((prompt_tokens, prompt_lengths))``
returning ``{"response_tokens", "response_lengths"}``, ``free()`` after it.
`TLTGenerateBackend` has that interface. Shapes follow NeMo-Aligner's: prompts
[B, T] right-padded with lengths [B]; ``response_tokens`` [B, max(response_lengths)]
holds each prompt followed by its response, padded with EOS; ``response_lengths``
counts prompt + response (EOS included when generated).

Config keys read (NeMo-Aligner's): ``trainer.ppo.trt_llm.{enable, reshard,
max_input_len, seed, model_type, unload_engine_train}``, ``trainer.ppo.trt_model_dir``,
``model.ppo.sampling_params.{use_greedy, temperature, top_k, top_p}``,
``model.ppo.length_params.max_length``, ``model.encoder_seq_length``; plus our
``tlt:`` block (`TLTBlock`). ``reshard`` (rollout at the training TP, PP folded into
DP) is recorded; the TP of the TensorRT-LLM engine is ``tlt.trtllm.tensor_parallel_size``.
``model_type`` is accepted for compatibility (TensorRT-LLM's LLM API reads the HF
config instead). Neither NeMo-Aligner nor TensorRT-LLM is imported here: the tests
exercise our side of the interface with the torch engine behind it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.checks import check_int
from nemo_tlt.config import plain_values
from nemo_tlt.device import Placement
from nemo_tlt.structured import build_structured
from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.rollout.config import RolloutConfig, TRTLLMRolloutSettings
from nemo_tlt.rollout.protocol import Request, RolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.spot.config import IdleDrafterConfig

log = logging.getLogger(__name__)

BACKENDS = ("torch", "trtllm")


@dataclass(frozen=True)
class TRTLLMBlock(TRTLLMRolloutSettings):
    """``tlt.trtllm``: the TensorRT-LLM engine's settings, ``rollout.trtllm``'s (drafter folder
    from ``nemo-tlt convert --from drafter --to eagle3-hf``), with TensorRT-LLM's dummy load
    (weights from the first refit) where no drafter is loaded."""

    dummy_load: bool = True


@dataclass(frozen=True)
class TLTBlock:
    """The ``tlt:`` block of a NeMo-Aligner config: which engine, and TLT's own blocks."""

    backend: str = "torch"                # torch (embedded engine) | trtllm
    target_dir: Optional[str] = None      # HF-format policy folder the engine is built from
    drafter_dir: Optional[str] = None     # torch backend: a nemo-tlt drafter folder (null: plain decoding)
    rollout: SpecDecodingConfig = field(default_factory=SpecDecodingConfig)
    drafter: IdleDrafterConfig = field(default_factory=IdleDrafterConfig)
    trtllm: TRTLLMBlock = field(default_factory=TRTLLMBlock)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"TLTBlock.backend must be one of {list(BACKENDS)}, got {self.backend!r}")


@dataclass(frozen=True)
class AlignerGenerationConfig:
    """What `TLTGenerateBackend` reads from a NeMo-Aligner PPO / REINFORCE config."""

    enable: bool
    reshard: bool
    max_input_len: int
    seed: int
    model_type: str
    unload_engine_train: bool
    trt_model_dir: str
    max_generation_length: int
    use_greedy: bool
    temperature: float
    top_k: int
    top_p: float
    tlt: TLTBlock

    def sampling(self) -> SamplingParams:
        mode = "greedy" if self.use_greedy else "rejection"
        return SamplingParams(mode=mode, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_new_tokens=self.max_generation_length, seed=self.seed)


# The resolvers NeMo-Aligner's YAML uses (registered by NeMo-Aligner itself when it runs).
_RESOLVERS = {"subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b, "int_div": lambda a, b: a // b}


def read_aligner_config(cfg: Mapping[str, Any] | DictConfig) -> AlignerGenerationConfig:
    """NeMo-Aligner's keys (interpolations resolved) plus the ``tlt:`` block; a missing
    key is a ValueError naming its path."""
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    root = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    plain = OmegaConf.to_container(root, resolve=True)

    def get(path: str) -> Any:
        node: Any = plain
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"NeMo-Aligner config: key '{path}' is missing")
            node = node[part]
        return node

    trt = "trainer.ppo.trt_llm."
    max_len = get("model.ppo.length_params.max_length")
    max_input = get(trt + "max_input_len")
    check_int("trainer.ppo.trt_llm.max_input_len", max_input, 1)
    check_int("model.ppo.length_params.max_length", max_len, 1)
    seq = get("model.encoder_seq_length")
    if max_input + max_len > seq:
        raise ValueError(f"trainer.ppo.trt_llm.max_input_len ({max_input}) + model.ppo.length_params.max_length "
                         f"({max_len}) must be <= model.encoder_seq_length ({seq})")
    sp = "model.ppo.sampling_params."
    tlt_values = plain.get("tlt", {}) if isinstance(plain, Mapping) else {}
    merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(_plain_block()), tlt_values or {}))
    return AlignerGenerationConfig(
        enable=bool(get(trt + "enable")), reshard=bool(get(trt + "reshard")), max_input_len=max_input,
        seed=int(get(trt + "seed")), model_type=str(get(trt + "model_type")),
        unload_engine_train=bool(get(trt + "unload_engine_train")), trt_model_dir=str(get("trainer.ppo.trt_model_dir")),
        max_generation_length=max_len, use_greedy=bool(get(sp + "use_greedy")),
        temperature=float(get(sp + "temperature")), top_k=int(get(sp + "top_k")), top_p=float(get(sp + "top_p")),
        tlt=build_structured(TLTBlock, merged, "tlt."))


def _plain_block() -> dict[str, Any]:
    """TLTBlock's defaults as plain values (arms as strings), the schema merged into."""
    return plain_values(TLTBlock())


def build_engine(tlt: TLTBlock, policy: SpecPolicy | None = None) -> RolloutEngine:
    """The engine ``tlt.backend`` names, serving ``tlt.target_dir``, through the loop's engine
    factory (``rollout.factory.build_rollout_engine``). The embedded engine loads the drafter of
    ``tlt.drafter_dir`` once built; TensorRT-LLM is built with ``tlt.trtllm`` (its drafter folder,
    fixed at build) and ``policy``'s draft-length schedule (see ``rollout.factory``)."""
    if tlt.target_dir is None:
        raise ValueError("tlt.target_dir is required: the HF-format policy folder the engine serves")
    from nemo_tlt.drafter.io import load_drafter
    from nemo_tlt.rollout.factory import build_rollout_engine
    load = tlt.drafter_dir is not None and tlt.backend != "trtllm"  # TensorRT-LLM's: tlt.trtllm.drafter_dir
    drafter = load_drafter(tlt.drafter_dir) if load else None
    # TensorRT-LLM places its own workers on the node's GPUs; the embedded engine runs where it did
    placement = Placement(torch.device("cuda")) if tlt.backend == "trtllm" else Placement()
    engine = build_rollout_engine(RolloutConfig(engine=tlt.backend, trtllm=tlt.trtllm), tlt.target_dir, placement,
                                  policy=policy)
    if drafter is not None:
        engine.load_drafter(drafter)
    return engine


class TLTGenerateBackend:
    """``GPTGenerateTRTLLM``'s interface over a `RolloutEngine` with TLT's SD policy."""

    def __init__(self, config: AlignerGenerationConfig, engine: RolloutEngine | None = None) -> None:
        self.config = config
        self.policy = config.tlt.rollout.build_policy(np.random.default_rng(config.seed))
        self.engine = build_engine(config.tlt, self.policy) if engine is None else engine
        self.sampling = config.sampling()
        self._step = 0

    def refit(self, model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights: a module (its canonical-named ``state_dict``), a
        canonical state dict, or a canonical (name, tensor) stream."""
        weights = model.state_dict() if isinstance(model, torch.nn.Module) else model
        self.engine.load_policy_weights(weights)

    def generate(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        prompt_tokens, prompt_lengths = inputs
        if prompt_tokens.dim() != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
            raise ValueError(f"generate: expected prompt_tokens [B, T] and prompt_lengths [B], got "
                             f"{tuple(prompt_tokens.shape)} and {tuple(prompt_lengths.shape)}")
        lengths = [int(n) for n in prompt_lengths]
        if max(lengths) > self.config.max_input_len:
            raise ValueError(f"generate: a prompt of {max(lengths)} tokens exceeds trainer.ppo.trt_llm.max_input_len="
                             f"{self.config.max_input_len}")
        requests = [Request(prompt_tokens[b, :n].tolist(), seq_id=b) for b, n in enumerate(lengths)]
        # a fresh seed per call: NeMo-Aligner draws new random seeds for every batch
        sampling = SamplingParams(**{**self.sampling.__dict__, "seed": self.sampling.seed + self._step})
        self._step += 1
        out = self.engine.generate(requests, sampling, policy=self.policy)
        eos = self.engine.model_config.eos_token_id
        seqs = [list(r.prompt) + res.tokens for r, res in zip(requests, out.results)]
        response_lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        tokens = torch.full((len(seqs), int(response_lengths.max())), eos, dtype=torch.long)
        for b, s in enumerate(seqs):
            tokens[b, :len(s)] = torch.tensor(s)
        self.last_stats = out.stats
        return {"response_tokens": tokens, "response_lengths": response_lengths}

    def free(self) -> None:
        """NeMo-Aligner frees the engine for training when ``unload_engine_train``; the
        engines here keep their weights (a refit follows anyway), so this only drops
        the last rollout's stats."""
        if self.config.unload_engine_train:
            self.last_stats = None
