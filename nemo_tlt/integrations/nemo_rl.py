"""A NeMo-RL ``GenerationInterface`` adapter over a `RolloutEngine` with TLT's SD policy.

Held to ``nemo_rl/models/generation/interfaces.py`` as recorded in
``interface_facts.NEMO_RL_GENERATION`` (the commit read is named there and in
docs/nemo.md): ``generate(data, greedy)`` takes a GenerationDatumSpec (``input_ids``
[B, T] right-padded, ``input_lengths`` [B]) and returns a GenerationOutputSpec:
``output_ids`` [B, S] in the input's dtype (input followed by generation, right-padded
with ``pad_token_id``), ``generation_lengths`` and ``unpadded_sequence_lengths`` [B]
int64, ``logprobs`` [B, S] float32 and ``truncated`` [B] bool. Where NeMo-RL is
importable the output is its ``BatchedDataDict``; elsewhere a plain dict of the same
tensors.

``logprobs`` are the engine's (``RequestResult.logprobs``) in NeMo-RL's layout, as its
vLLM and SGLang backends write them: ``logprobs[b, P_b + i]`` is the log-prob of the
i-th generated token (``output_ids[b, P_b + i]``, P_b the prompt length), zeros over the
prompt and the padding. They are the sampling transform's (temperature, top-k, top-p),
or the raw log-softmax under ``greedy=True`` (``speculative.sampling.token_logprobs``);
NeMo-RL's policy computes its own at its temperature, so its ``token_mult_prob_error``
compares like with like when the generation temperature is the policy's and no top-k /
top-p is set.
``stop_strings`` in the datum is refused (the engines stop on EOS and length only).
Weights: ``prepare_refit_info`` keeps the {name: (shape, dtype)} map;
``update_weights_from_collective`` loads the canonical stream that the
``weight_source`` callable given at construction produces (the caller's collective
receive); NeMo-RL's Ray/NCCL plumbing itself is not reproduced, so ``init_collective``
joins no process group.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.integrations.nemo_aligner import TLTBlock, build_engine
from nemo_tlt.rollout.protocol import PolicyWeights, Request, RolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams


class TLTGeneration:
    def __init__(self, engine: RolloutEngine, sampling: SamplingParams, pad_token_id: int,
                 spec: SpecDecodingConfig | None = None, seed: int = 0,
                 weight_source: Callable[[], PolicyWeights] | None = None) -> None:
        if sampling.mode == "greedy":
            raise ValueError("TLTGeneration.sampling is the non-greedy sampling; generate(greedy=True) selects greedy")
        self.engine, self.sampling, self.pad_token_id = engine, sampling, pad_token_id
        self.policy = (spec or SpecDecodingConfig(sd_enabled=False)).build_policy(np.random.default_rng(seed))
        self.weight_source = weight_source
        self.state_dict_info: dict[str, Any] | None = None
        self._calls = 0

    @classmethod
    def from_tlt_block(cls, tlt: TLTBlock, sampling: SamplingParams, pad_token_id: int, seed: int = 0,
                       weight_source: Callable[[], PolicyWeights] | None = None) -> "TLTGeneration":
        """The engine ``tlt.backend`` names (``torch`` or ``trtllm``, as in the NeMo-Aligner
        backend), with ``tlt.rollout``'s SD policy."""
        return cls(build_engine(tlt), sampling, pad_token_id, spec=tlt.rollout, seed=seed,
                   weight_source=weight_source)

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        """No process group of its own: weights arrive through ``weight_source``."""
        return []

    def shutdown(self) -> bool:
        """Nothing to release beyond the engine object itself; safe to call repeatedly."""
        return True

    def generate(self, data: Mapping[str, torch.Tensor], greedy: bool = False) -> dict[str, torch.Tensor]:
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"generate: data has no {key!r} (GenerationDatumSpec keys: input_ids, input_lengths)")
        stop_strings = data.get("stop_strings") if isinstance(data, Mapping) else None
        if stop_strings is not None and any(s for s in stop_strings):
            raise ValueError("generate: data['stop_strings'] is not supported (the engines stop on EOS and "
                             "max_new_tokens only)")
        ids, lengths = data["input_ids"], [int(n) for n in data["input_lengths"]]
        requests = [Request(ids[b, :n].tolist(), seq_id=b) for b, n in enumerate(lengths)]
        mode = "greedy" if greedy else self.sampling.mode
        sampling = SamplingParams(**{**self.sampling.__dict__, "mode": mode, "seed": self.sampling.seed + self._calls})
        self._calls += 1
        out = self.engine.generate(requests, sampling, policy=self.policy)
        gen = torch.tensor([len(r.tokens) for r in out.results], dtype=torch.long)
        total = torch.tensor(lengths, dtype=torch.long) + gen
        output_ids = torch.full((len(requests), int(total.max())), self.pad_token_id, dtype=ids.dtype)
        logprobs = torch.zeros(output_ids.shape, dtype=torch.float32)  # zeros over prompts and padding
        for b, (req, res) in enumerate(zip(requests, out.results)):
            output_ids[b, :int(total[b])] = torch.tensor(list(req.prompt) + res.tokens, dtype=ids.dtype)
            logprobs[b, len(req.prompt): int(total[b])] = torch.tensor(res.logprobs, dtype=torch.float32)
        out_spec = {"output_ids": output_ids, "generation_lengths": gen, "unpadded_sequence_lengths": total,
                    "logprobs": logprobs,
                    "truncated": torch.tensor([r.stop_reason == "length" for r in out.results], dtype=torch.bool)}
        if importlib.util.find_spec("nemo_rl") is None:
            return out_spec
        return importlib.import_module("nemo_rl.distributed.batched_data_dict").BatchedDataDict(out_spec)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        self.state_dict_info = dict(state_dict_info)

    def update_weights_from_collective(self) -> list:
        if self.weight_source is None:
            raise ValueError("update_weights_from_collective: TLTGeneration was built without a weight_source "
                             "(a callable returning the canonical weight stream)")
        self.engine.load_policy_weights(self.weight_source())
        return []

    def update_weights(self, weights: PolicyWeights) -> bool:
        """Load canonical weights given directly (a state dict or a stream)."""
        self.engine.load_policy_weights(weights)
        return True
