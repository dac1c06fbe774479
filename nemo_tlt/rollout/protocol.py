"""The `RolloutEngine` protocol and the values that cross it.

The embedded torch engine (``torch_engine.py``) is the only implementation so far.
The protocol is the surface a second backend (a TensorRT-LLM engine is planned)
must offer: the same requests in, the same results and stats out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nemo_tlt.speculative.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    seq_id: int | None = None  # keys the coupled-sampling noise; defaults to the request's index

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))


@dataclass
class RequestResult:
    tokens: list[int]
    stop_reason: str                          # "eos" | "length"
    hidden_states: torch.Tensor | None = None  # [prompt_len + len(tokens) - 1, H]: feature at t predicts t+1


@dataclass
class StepTrace:
    running: int
    shape: str | None          # tree shape name, None for a plain step
    tokens: int                # tokens emitted in this step (all rows)
    mean_accept: float         # tokens per row in this step
    seconds: float
    kv_bytes: int = 0          # KV cache bytes held (target + drafter) during the step


@dataclass
class GenerationStats:
    target_forwards: int = 0     # prefill chunks + decode steps
    prefill_forwards: int = 0
    drafter_forwards: int = 0
    plain_steps: int = 0
    sd_steps: int = 0
    tokens_generated: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens per row per verify step (1..depth+1)
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_plain_s: float = 0.0
    time_other_s: float = 0.0
    prefill_s: float = 0.0       # allocation + prompt forwards + first token (part of time_plain_s and other)
    wall_s: float = 0.0
    trace: list[StepTrace] = field(default_factory=list)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def outside_steps_s(self) -> float:
        """Wall time not spent in decode steps: prefill, retiring finished rows, policy."""
        return self.wall_s - sum(t.seconds for t in self.trace)

    def accept_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.accept_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    def summary(self) -> dict[str, Any]:
        return {
            "target_forwards": self.target_forwards,
            "prefill_forwards": self.prefill_forwards,
            "drafter_forwards": self.drafter_forwards,
            "plain_steps": self.plain_steps,
            "sd_steps": self.sd_steps,
            "tokens_generated": self.tokens_generated,
            "mean_accept_len": self.mean_accept_len,
            "accept_histogram": self.accept_histogram(),
            "time_draft_s": self.time_draft_s,
            "time_verify_s": self.time_verify_s,
            "time_plain_s": self.time_plain_s,
            "time_other_s": self.time_other_s,
            "prefill_s": self.prefill_s,
            "outside_steps_s": self.outside_steps_s,
            "wall_s": self.wall_s,
        }


@dataclass
class GenerateOutput:
    results: list[RequestResult]
    stats: GenerationStats


class RolloutEngine(Protocol):
    def load_policy_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def load_drafter(self, drafter: Any) -> None: ...

    def generate(self, requests: list[Request], sampling: SamplingParams,
                 return_hidden: bool = False) -> GenerateOutput: ...
