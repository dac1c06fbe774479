"""A health metric of the rollout: how far the engine's generation log-probs are from the
policy's log-probs of the same tokens (pure functions, no I/O).

Both sides should be one distribution: the engine serves the policy's weights and reports
each token's log-prob under the transform it sampled with (``RequestResult.logprobs``);
the policy computes ``log_softmax(logits / grpo.temperature)`` of the same tokens. They
differ by arithmetic (batching, kernels, dtype; bf16 serving) and by anything that went
wrong (stale weights after a sync, a broken verify step), which is what the metric shows.

Per step, over every response token whose generation log-prob is finite:

* ``logprob_gap``: mean |policy - generation|;
* ``token_mult_prob_error``: mean exp(|policy - generation|), NeMo-RL's metric of that
  name (``ClippedPGLossFn``: the token mean of ``exp(|generation_logprobs -
  prev_logprobs|)``), 1.0 when they agree.

Like with like: the rollout samples with ``grpo.temperature`` and no top-k / top-p, so the
engine's transform is the policy's, except in ``greedy`` mode, whose log-probs are the raw
log-softmax (temperature 1): there they are compared only at ``grpo.temperature == 1``
(`comparable`), else the metrics are None.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

GAP_SUMS = ("logprob_gap_abs_sum", "logprob_gap_mult_sum", "logprob_gap_tokens")


def comparable(acceptance: str, temperature: float) -> bool:
    """Whether the engine's log-probs in mode ``acceptance`` are the policy's transform."""
    return acceptance != "greedy" or temperature == 1.0


def gap_sums(generation: Sequence[Sequence[float]], policy: Sequence[torch.Tensor]) -> dict[str, float]:
    """One rank's sums over its sequences (``generation[i]`` and ``policy[i]``: one value per
    response token of sequence i), to be combined across ranks by `gap_metrics`. A
    non-finite generation log-prob (one an engine could not report) is left out."""
    if len(generation) != len(policy):
        raise ValueError(f"gap_sums: {len(generation)} generation sequences, {len(policy)} policy ones")
    for i, (g, p) in enumerate(zip(generation, policy)):
        if len(g) != p.numel():
            raise ValueError(f"gap_sums: sequence {i} has {len(g)} generation log-probs, {p.numel()} policy ones")
    if not generation:
        return dict.fromkeys(GAP_SUMS, 0.0)
    gen = torch.tensor([x for g in generation for x in g], dtype=torch.float64, device="cpu")
    pol = torch.cat([p.detach().reshape(-1) for p in policy]).to("cpu", torch.float64)  # one read
    finite = torch.isfinite(gen)
    diff = (pol - gen)[finite].abs()
    return {"logprob_gap_abs_sum": float(diff.sum()), "logprob_gap_mult_sum": float(diff.exp().sum()),
            "logprob_gap_tokens": float(finite.sum())}


def gap_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float | None]:
    """The step's metrics from every rank's `gap_sums` (a rank without them is skipped;
    None where no rank had any token)."""
    have = [p for p in parts if all(k in p for k in GAP_SUMS)]
    tokens = sum(p["logprob_gap_tokens"] for p in have)
    if not tokens:
        return {"logprob_gap": None, "token_mult_prob_error": None}
    return {"logprob_gap": sum(p["logprob_gap_abs_sum"] for p in have) / tokens,
            "token_mult_prob_error": sum(p["logprob_gap_mult_sum"] for p in have) / tokens}
