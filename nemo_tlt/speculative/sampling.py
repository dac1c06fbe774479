"""How a token is drawn from the target's logits, as pure functions.

Three modes, each with its speculative-decoding counterpart:

* ``greedy``: argmax. SD with greedy acceptance is token-identical to it.
* ``rejection``: an ordinary random draw from the processed distribution, using
  an explicit `torch.Generator`. SD with rejection acceptance samples exactly this
  distribution (tested statistically), though not the same tokens.
* ``coupled``: argmax(log-softmax + Gumbel noise), where the noise for the token
  at absolute `position` of sequence `seq_id` is a hash of (seed, seq_id, position,
  vocab index). Gumbel-max makes that an exact sample of the processed
  distribution, and because the noise does not depend on the batch, the tree or
  the step, SD and plain decoding produce the same tokens for the same seed.

The log-probability reported for a generated token (`sampling_logprobs`, `token_logprobs`)
is the one of the transform that drew it: ``process_logits`` (temperature, top-k,
top-p) for ``rejection`` and ``coupled``; for ``greedy``, which has no distribution of
its own, the log-softmax of the raw logits (temperature 1, no filter), as vLLM's
``raw_logprobs`` reports them. Always computed in fp32.

Devices: every tensor is made on the device of the logits / sequence ids, and a
draw's generator must live there too. The coupled noise is computed on that device,
elementwise from the key (exact 64-bit integer hashing, then a double-precision
``-log(-log(u))`` rounded to fp32), so plain and speculative decoding on one device
draw bit-identical noise whatever the batch or tree. Across devices the integer
hash is identical, but the device's double ``log`` may differ from the host's in
the last bit, which changes the fp32 noise very rarely (about 2**-29 per value); the
logits differ across devices anyway, so tokens are promised identical within one
device and engine configuration, and equal in distribution across devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from nemo_tlt.checks import check_float, check_int

Mode = Literal["greedy", "rejection", "coupled"]
MODES: tuple[str, ...] = ("greedy", "rejection", "coupled")


@dataclass(frozen=True)
class SamplingParams:
    mode: Mode = "greedy"
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SamplingParams.mode must be one of {MODES}, got {self.mode!r}")
        check_float("SamplingParams.temperature", self.temperature, 0, lo_open=True)
        check_int("SamplingParams.top_k", self.top_k, 0)
        check_float("SamplingParams.top_p", self.top_p, 0, 1, lo_open=True)
        check_int("SamplingParams.max_new_tokens", self.max_new_tokens, 1)
        check_int("SamplingParams.seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.stop_on_eos, bool):
            raise ValueError(f"SamplingParams.stop_on_eos must be a bool, got {self.stop_on_eos!r}")


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p; returns log-probabilities (filtered entries -inf)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-probabilities (fp32, over the last dim) under which ``params.mode`` draws:
    ``process_logits`` for rejection / coupled, the raw log-softmax for greedy."""
    if params.mode == "greedy":
        return logits.float().log_softmax(-1)
    return process_logits(logits, params)


def token_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: torch.Tensor) -> torch.Tensor:
    """The `sampling_logprobs` of ``tokens`` (logits [..., V], tokens [...]; a negative id,
    a padding slot, reads token 0): the log-probability each generated token is reported with."""
    logp = sampling_logprobs(logits, params)
    return logp.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 lanes (products stay below 2**63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def coupled_gumbel(seed: int, seq_ids: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [N, vocab] keyed by (seed, seq_id, position, token)."""
    key = _mix32(torch.full_like(seq_ids, seed & _M32) ^ _mix32(torch.full_like(seq_ids, (seed >> 32) & _M32)))
    key = _mix32(key ^ (seq_ids.long() & _M32))
    key = _mix32(key ^ (positions.long() & _M32))
    tok = torch.arange(vocab, dtype=torch.long, device=seq_ids.device)
    h = _mix32(key[:, None] ^ ((tok[None, :] * 0x9E3779B1) & _M32))
    h2 = _mix32(h ^ 0x5BD1E995)
    # 53 random bits -> a uniform strictly inside (0, 1)
    u = ((h << 21) ^ (h2 & 0x1FFFFF)).double().add(0.5).div(2.0**53)
    return (-torch.log(-torch.log(u))).float()


def coupled_noise_table(seed: int, seq_ids: torch.Tensor, first_position: torch.Tensor, count: int,
                        vocab: int) -> torch.Tensor:
    """The coupled noise of `count` consecutive positions per row, [B, count, V]:
    table[b, j] = coupled_gumbel(seed, seq_ids[b], first_position[b] + j). One call
    serves a whole speculative step (the drafter's ranking and the verification)."""
    B = seq_ids.shape[0]
    positions = first_position[:, None] + torch.arange(count, device=seq_ids.device)
    return coupled_gumbel(seed, seq_ids.repeat_interleave(count), positions.flatten(), vocab).view(B, count, vocab)


def coupled_draw(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """argmax(processed log-probs + noise) over the last dim: the ``coupled`` draw
    given its noise (same shape as logits)."""
    return (process_logits(logits, params) + noise).argmax(-1)


def draw(logits: torch.Tensor, params: SamplingParams, seq_ids: torch.Tensor, positions: torch.Tensor,
         generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of logits [N, V]; `positions` are the absolute positions
    of the tokens being drawn (used by ``coupled`` only)."""
    if params.mode == "greedy":
        return logits.argmax(-1)
    if params.mode == "coupled":
        return coupled_draw(logits, params, coupled_gumbel(params.seed, seq_ids, positions, logits.shape[-1]))
    return torch.multinomial(process_logits(logits, params).exp(), 1, generator=generator).squeeze(-1)
