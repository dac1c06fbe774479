"""What TensorRT-LLM reports about speculation, mapped into our `GenerationStats` (pure).

TensorRT-LLM's LLM API reports acceptance per request, not per decode step
(``interface_facts``, "per-request speculation"):

* ``RequestOutput.decoding_iter``: the decode iterations the request ran;
* ``RequestOutput.avg_decoded_tokens_per_iter``: tokens decoded per iteration (the
  target's token plus the accepted draft tokens), None when not reported;
* with ``SamplingParams(return_perf_metrics=True)``,
  ``CompletionOutput.request_perf_metrics.speculative_decoding``:
  ``total_accepted_draft_tokens`` and ``total_draft_tokens``.

TensorRT-LLM's own acceptance length (AL) is the iteration-weighted mean of the
per-request figure: total decoded tokens / total decode iterations. The torch engine
reports ``accept_lengths``: tokens per row per verify step, whose mean is the same
quantity. The mapping gives each request ``decoding_iter`` entries summing to
``round(avg * decoding_iter)`` (spread evenly: the per-step split is not reported), so
``GenerationStats.mean_accept_len`` is TensorRT-LLM's AL exactly and the histogram is
an evened-out one. Batch-level step counts (``sd_steps``, ``target_forwards``) stay 0:
per-request iterations of a batch share forwards, which the LLM API does not report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculationReport:
    """One rollout's speculation as TensorRT-LLM reported it (None: not reported)."""

    requests: int                      # requests that reported avg_decoded_tokens_per_iter
    iterations: int                    # their decode iterations, summed
    decoded_tokens: int                # round(avg * iterations), summed
    accepted_draft_tokens: int | None  # request_perf_metrics.speculative_decoding, summed
    draft_tokens: int | None

    @property
    def mean_accept_len(self) -> float:
        """Tokens per decode iteration, iteration-weighted (TensorRT-LLM's AL)."""
        return self.decoded_tokens / self.iterations if self.iterations else 0.0

    @property
    def draft_acceptance(self) -> float | None:
        """Accepted / drafted draft tokens over the rollout."""
        if not self.draft_tokens:
            return None
        return self.accepted_draft_tokens / self.draft_tokens

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "iterations": self.iterations, "decoded_tokens": self.decoded_tokens,
                "mean_accept_len": self.mean_accept_len, "accepted_draft_tokens": self.accepted_draft_tokens,
                "draft_tokens": self.draft_tokens, "draft_acceptance": self.draft_acceptance}


def even_split(tokens: int, steps: int) -> list[int]:
    """``steps`` integers summing to ``tokens``, differing by at most one."""
    base, extra = divmod(tokens, steps)
    return [base + 1] * extra + [base] * (steps - extra)


def _spec_counters(output: Any) -> tuple[int, int] | None:
    metrics = getattr(output.outputs[0], "request_perf_metrics", None)
    spec = None if metrics is None else metrics.speculative_decoding
    if spec is None:
        return None
    return int(spec.total_accepted_draft_tokens), int(spec.total_draft_tokens)


def speculation_report(outputs: list[Any]) -> tuple[SpeculationReport, list[int]]:
    """The rollout's `SpeculationReport` and the ``accept_lengths`` entries (one per
    request per decode iteration) from TensorRT-LLM's ``RequestOutput`` list. A request
    reporting a tokens-per-iteration figure with no positive ``decoding_iter``, or a
    figure below 1, is a ValueError (TensorRT-LLM decodes at least one token per
    iteration)."""
    accept: list[int] = []
    requests = iterations = tokens = 0
    accepted = drafted = 0
    counted = False
    for i, out in enumerate(outputs):
        counters = _spec_counters(out)
        if counters is not None:
            counted = True
            accepted, drafted = accepted + counters[0], drafted + counters[1]
        avg = out.avg_decoded_tokens_per_iter
        if avg is None:
            continue
        steps = out.decoding_iter
        if not isinstance(steps, int) or steps < 1 or avg < 1:
            raise ValueError(f"TensorRT-LLM reported request {i} with avg_decoded_tokens_per_iter={avg!r} over "
                             f"decoding_iter={steps!r}; expected >= 1 token over >= 1 iteration")
        made = round(avg * steps)
        accept += even_split(made, steps)
        requests, iterations, tokens = requests + 1, iterations + steps, tokens + made
    report = SpeculationReport(requests, iterations, tokens, accepted if counted else None,
                               drafted if counted else None)
    return report, accept
