"""``PolicyBackend``: the whole surface of a trainable policy the RL loop uses.

Contract (every implementation)
-------------------------------
* A rollout batch is a list of ``(prompt, response)`` token lists
  (``nemo_tlt.policy.batching``). Log-probs are those of the sampling distribution,
  ``log_softmax(logits / temperature)`` at the response positions (the EOS a response
  ended with included), one ``[len(response)]`` tensor per sequence.
* ``logprobs(batch, current)`` returns ``(old, ref)``: the current policy's log-probs
  (None unless ``current``) and the frozen reference's (None without ``kl_coef > 0``).
* ``update(batch, advantages, logp_old, logp_ref, global_tokens, counted=None)`` makes exactly
  one optimizer step on the run's algorithm's policy loss (``RLAlgorithm.policy_loss``, built
  in by the factory's ``algorithm``; + KL) as a token mean over ``global_tokens`` counted
  response tokens of the whole step; ``counted[B]`` (bool, None: all) restricts the loss, the
  KL and the stats to those sequences: each micro-batch adds ``sum(loss) / global_tokens``,
  and the backend sums gradients over its data-parallel replicas itself, so every
  replica takes the same step and stays identical. ``logp_old=None``: the update
  forward's own log-probs, detached (ratio 1). Returns ``loss, pg_loss, kl, clip_frac,
  approx_kl`` (this rank's share of the token mean), ``grad_norm`` and ``lr``.
* ``on_logprobs(index, logprobs[R])``, if given to ``update``, receives the update
  forward's log-probs of every sequence's response tokens (detached, before the step:
  those of the weights the rollout was served), on every rank holding the last pipeline
  stage (the torch backend: every rank); a health metric compares them with the engine's.
* ``on_hidden(index, tokens[L], hidden[L, H])``, if given and ``captures_hidden``, is
  called for every sequence of the batch, on every rank that called, with the final
  hidden states (after the final norm, detached, float) of the same forward that
  computed the log-probs; ``index`` is the sequence's position in ``batch`` and
  ``hidden[t]`` is the feature that predicts ``tokens[t + 1]``.
* ``capture_layers`` (with ``on_hidden``; an EAGLE-3 drafter's k target layers, 0-based,
  in its order, repeats allowed) asks for the EAGLE-3 features instead: ``hidden`` is
  ``[L, (k + 1) * H]``, the outputs of those decoder layers (before the final norm) in
  that order, then the final hidden state: the layout the torch rollout engine keeps
  for such a drafter. Still the same forward, no extra pass. Indices outside
  ``[0, num_layers)`` (or an empty tuple) raise a ValueError naming ``capture_layers``
  and ``num_layers``, before any collective.
* ``canonical_weights(rollout_tp=1)`` yields the canonical (HF-named) weights, tensor by
  tensor, on every rank: whole, or, at ``rollout_tp`` > 1, either whole or only the rank's
  rollout slices (``nemo_tlt.weights.rollout``, TP rank = rank % rollout_tp), as the backend
  can send them cheapest; the TP rollout engine takes either. For a model-parallel backend
  it is a collective: every rank iterates it to the end. A consumer must not assume the
  backend holds no full copy.
* ``state_dict()`` / ``load_state_dict()`` hold the optimizer and the schedule step
  (for resume); ``sharded_state`` says whether they differ per rank (then a checkpoint
  keeps every rank's). ``load_canonical`` replaces the weights (the KL reference keeps
  the initial policy).
* ``train_ranks``: the global ranks whose rollouts this rank trains on together, in
  order (its model-parallel group when TP x PP > 1, else just itself).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.batching import Sequence2

# (batch index, tokens [L], hidden [L, H], or [L, (k + 1) * H] with capture_layers)
HiddenSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# (batch index, the update forward's detached log-probs of that sequence's response tokens [R])
LogprobSink = Callable[[int, torch.Tensor], None]
STATS = ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")


@runtime_checkable
class PolicyBackend(Protocol):
    @property
    def model_config(self) -> LMConfig: ...

    @property
    def train_ranks(self) -> tuple[int, ...]: ...

    @property
    def sharded_state(self) -> bool: ...

    @property
    def captures_hidden(self) -> bool: ...

    def logprobs(self, batch: Sequence[Sequence2], current: bool = True, *, on_hidden: HiddenSink | None = None,
                 capture_layers: tuple[int, ...] | None = None
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]: ...

    def update(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
               logp_ref: list[torch.Tensor] | None, global_tokens: int, *, on_hidden: HiddenSink | None = None,
               capture_layers: tuple[int, ...] | None = None, on_logprobs: LogprobSink | None = None,
               counted: torch.Tensor | None = None) -> dict[str, float]: ...

    def canonical_weights(self, rollout_tp: int = 1) -> Iterator[tuple[str, torch.Tensor]]: ...

    def load_canonical(self, weights: Mapping[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class PipelinedAccumulation(Protocol):
    """What a backend adds for ``policy.pipelined_update`` (``nemo_tlt.rl.update.pipelined_step``): a
    step's gradient built in terms (GRPO groups, or one micro-batch of one: ``part``) while
    the rollout's tail runs, summed in fixed point so that the order of the terms does not
    change a bit, then applied once."""

    def begin_accumulation(self, token_budget: int) -> None: ...

    def num_parts(self, batch: Sequence[Sequence2]) -> int: ...

    def accumulate(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
                   logp_ref: list[torch.Tensor] | None, *, on_hidden: HiddenSink | None = None,
                   capture_layers: tuple[int, ...] | None = None, on_logprobs: LogprobSink | None = None,
                   part: int | None = None, counted: torch.Tensor | None = None) -> dict[str, float]: ...

    def apply_accumulated(self, global_tokens: int) -> dict[str, float]: ...


@runtime_checkable
class ShardedCheckpoints(Protocol):
    """What a backend whose ``sharded_state`` is true adds (``nemo_tlt.rl.state.sharded_run_checkpoint``):
    each rank writes and reads its own shard of the policy state, collectively; a write may
    run in the background (``start_save_sharded`` returns what to wait on, ``finish_writes``
    waits for every write started)."""

    def save_sharded(self, directory: str) -> None: ...

    def start_save_sharded(self, directory: str) -> Any: ...

    def finish_writes(self) -> None: ...

    def load_sharded(self, directory: str) -> None: ...


@runtime_checkable
class OffloadsTrainingState(Protocol):
    """What a backend adds for ``rollout.training_state=offload`` (``nemo_tlt.rl.training_state``):
    ``offload_training_state()`` moves everything the policy keeps on its device for training
    (weights, gradient buffers, optimizer state, the KL reference) to host memory (pinned where
    CUDA is available) and releases the device storage; the rollout engine holds its own copy
    of the weights, so the rollout needs none of it. ``reload_training_state()`` brings it back
    before the policy is used again; the policy then computes bit for bit as if it had stayed.
    Every tensor keeps its identity through the move (its storage is released and refilled in
    place), so references held elsewhere stay valid; between the two calls none may be read.
    Both are per-rank (no collective); a second offload before a reload is an error, a reload
    of a resident state does nothing."""

    def offload_training_state(self) -> None: ...

    def reload_training_state(self) -> None: ...


def missing_methods(backend: Any, part: type) -> list[str]:
    """The methods of the sub-protocol ``part`` that ``backend`` (a class or an instance) lacks."""
    names = [n for n, v in vars(part).items() if callable(v) and not n.startswith("_")]
    return [n for n in names if not callable(getattr(backend, n, None))]


def require(policy: PolicyBackend, part: type, backend: str, setting: str) -> None:
    """A ValueError naming ``setting``, the backend and the missing methods when ``policy``
    lacks the optional contract ``part`` (one of this module's sub-protocols) the setting needs."""
    missing = missing_methods(policy, part)
    if missing:
        raise ValueError(f"{setting}: the {backend} policy backend does not implement {part.__name__} "
                         f"(nemo_tlt.policy.protocol; missing {missing})")


def check_update_args(owner: str, batch: Sequence[Sequence2], advantages: torch.Tensor, global_tokens: int,
                      counted: torch.Tensor | None = None) -> None:
    if advantages.shape != (len(batch),):
        raise ValueError(f"{owner}.update: advantages must be [{len(batch)}], got {tuple(advantages.shape)}")
    if counted is not None and (counted.shape != (len(batch),) or counted.dtype != torch.bool):
        raise ValueError(f"{owner}.update: counted must be a bool [{len(batch)}] tensor, got "
                         f"{counted.dtype} {tuple(counted.shape)}")
    if global_tokens < 1:
        raise ValueError(f"{owner}.update: global_tokens must be >= 1, got {global_tokens}")


def check_capture_layers(owner: str, capture_layers: Sequence[int] | None, num_layers: int
                         ) -> tuple[int, ...] | None:
    """``capture_layers`` as a tuple (None stays None), or a ValueError naming it and ``num_layers``."""
    if capture_layers is None:
        return None
    layers = tuple(capture_layers)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
        raise ValueError(f"{owner}: capture_layers={layers} must list decoder layer indices in [0, {num_layers}) "
                         f"(num_layers={num_layers}, 0-based), or be None for the final hidden state alone")
    return layers
