"""The `RolloutEngine` contract's input checks, shared by every engine (pure).

Bad input is a ValueError naming the field, raised before any decoding
(tests/conformance/test_errors.py holds every engine to it).
"""
from __future__ import annotations

from dataclasses import replace

from nemo_tlt.model.config import LMConfig
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams


def check_sampling(sampling: SamplingParams) -> None:
    """SamplingParams validates its values at construction; its integer fields are
    checked for type here, and it is validated again, so a value set after
    construction (object.__setattr__ on the frozen dataclass) is refused too."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"generate: sampling must be a SamplingParams, got {type(sampling).__name__}")
    for name in ("max_new_tokens", "top_k", "seed"):
        value = getattr(sampling, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"SamplingParams.{name} must be an int, got {value!r}")
    if not isinstance(sampling.stop_on_eos, bool):
        raise ValueError(f"SamplingParams.stop_on_eos must be a bool, got {sampling.stop_on_eos!r}")
    replace(sampling)  # runs SamplingParams.__post_init__ again


def validate_requests(requests: list[Request], sampling: SamplingParams, cfg: LMConfig) -> None:
    """`sampling` (see `check_sampling`) and every request against the served model
    `cfg`: a non-empty list of Requests, non-empty prompts of token ids in
    [0, vocab_size) that leave room for ``max_new_tokens`` in the context."""
    check_sampling(sampling)
    if not isinstance(requests, list) or not requests:
        raise ValueError("generate: requests is empty or not a list; give at least one Request")
    ctx, vocab = cfg.max_position_embeddings, cfg.vocab_size
    for i, req in enumerate(requests):
        if not isinstance(req, Request):
            raise ValueError(f"requests[{i}] must be a Request, got {type(req).__name__}")
        if len(req.prompt) == 0:
            raise ValueError(f"requests[{i}].prompt is empty; a prompt needs at least one token")
        if len(req.prompt) + sampling.max_new_tokens > ctx:
            raise ValueError(f"requests[{i}].prompt has {len(req.prompt)} tokens; with sampling.max_new_tokens="
                             f"{sampling.max_new_tokens} it exceeds the context of {ctx} (max_position_embeddings)")
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise ValueError(f"requests[{i}].prompt has token ids outside [0, {vocab}) (vocab_size)")


def refuse_coupled(sampling: SamplingParams, engine: str, sampler: str) -> None:
    """``coupled`` is refused by engines whose sampler draws from ``sampler`` rather than noise
    keyed by (seed, seq_id, position): their SD would not reproduce plain decoding's tokens."""
    if sampling.mode == "coupled":
        raise ValueError(f"SamplingParams.mode='coupled' is not expressible with {engine}: its sampler draws from "
                         f"{sampler}, not noise keyed by (seed, seq_id, position), so SD would not reproduce plain "
                         "decoding's tokens; use 'greedy' or 'rejection' (the target distribution), or the torch "
                         "engine for 'coupled'")
