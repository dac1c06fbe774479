"""The plain-PyTorch policy backend: a ``DecoderLM`` replica per rank, AdamW, pure data parallelism.

Contract: ``PolicyBackend`` (``nemo_tlt.policy.protocol``), plus
* every rank holds the whole model on its device (``Placement``), in the run's weights
  dtype; a bf16 model trains through fp32 master weights (``MasterWeights``): gradients
  are cast to fp32, summed over all ranks of the default process group (if one is
  initialised) through one flat float32 buffer, clipped and stepped by an AdamW whose
  state is fp32, and rounded back into the model. The replicas take bit-identical steps.
  A single rank needs no process group. Log-probs are computed in fp32 from the logits.
* ``captures_hidden`` is True: the log-prob forward is ``logits(hidden(ids))``, so the
  final hidden states come for free; with ``capture_layers`` it is
  ``DecoderLM.hidden_capture``, which taps those layers in the same forward.
* ``canonical_weights`` streams the replica's own weights (no communication).
* With ``kl_coef > 0`` a frozen copy of the initial policy is the KL reference.
* Nothing here is random: the model is built under a forked RNG, so building a backend
  leaves the global RNG as it was.
* ``OffloadsTrainingState``: ``offload_training_state`` copies the weights, the fp32 masters,
  the AdamW state and the KL reference to host memory and releases their device storage, and
  releases the gradients (every update zeroes them first); ``reload_training_state`` restores
  them in place (``nemo_tlt.model.offload.HostOffload``). The module's buffers (the rotary
  tables) stay.
"""
from __future__ import annotations

import copy
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from nemo_tlt.algorithms.grpo import GRPO
from nemo_tlt.algorithms.loss import policy_and_kl_loss, token_logprobs
from nemo_tlt.algorithms.protocol import RLAlgorithm
from nemo_tlt.device import Placement
from nemo_tlt.dist import allreduce_flat
from nemo_tlt.drafter.features import join_features
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.offload import HostOffload
from nemo_tlt.optim import build_optimizer
from nemo_tlt.policy.batching import (MicroBatch, Sequence2, counted_mask, micro_batches, padded, plan_micro_batches,
                                     scatter)
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.policy.fixed_point import FixedPointGrads
from nemo_tlt.policy.master_weights import MasterWeights
from nemo_tlt.policy.protocol import STATS, HiddenSink, LogprobSink, check_capture_layers, check_update_args


def build_decoder(canonical: Mapping[str, torch.Tensor], model_config: LMConfig,
                  placement: Placement | None = None) -> DecoderLM:
    """A ``DecoderLM`` holding a copy of ``canonical``, on ``placement``'s device in its dtype
    (None: the host, in the dtype of ``canonical``); the global RNG is left untouched."""
    state = {k: v for k, v in canonical.items() if not (model_config.tie_word_embeddings and k == "lm_head.weight")}
    with torch.random.fork_rng(devices=[]):
        model = DecoderLM(model_config)
    model.load_state_dict(state, strict=True)
    if placement is None:
        return model.to(next(iter(state.values())).dtype)
    return model.to(placement.device, placement.dtype)


class TorchPolicy:
    """One rank's policy replica, its AdamW + schedule and the optional KL reference;
    ``algorithm``'s ``policy_loss`` is the loss it minimises (None: GRPO's)."""

    def __init__(self, model: DecoderLM, config: PolicyConfig, *, temperature: float,
                 algorithm: RLAlgorithm | None = None) -> None:
        if config.model_parallel != 1:
            raise ValueError(f"TorchPolicy: policy.tensor_parallel x pipeline_parallel={config.model_parallel}; "
                             "the torch backend runs a whole replica per rank (TP = PP = 1)")
        if not temperature > 0:
            raise ValueError(f"TorchPolicy: temperature must be > 0, got {temperature!r}")
        self.model, self.config, self.temperature = model.train(), config, temperature
        self.algorithm = GRPO() if algorithm is None else algorithm
        self.device = model.lm_head_weight.device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = MasterWeights(self.params)
        # foreach=False: torch's per-parameter AdamW loop (its CPU default) on every device, as
        # in the megatron backend, so the update's arithmetic does not change with the device.
        self.optimizer, self.schedule = build_optimizer(self.master.masters, config.optim, foreach=False)
        self.step = 0  # optimizer steps taken (drives the schedule)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if config.kl_coef > 0 else None
        self._host = HostOffload(self.device)

    # ---- the contract's properties -------------------------------------------------
    @property
    def model_config(self) -> LMConfig:
        return self.model.config

    @property
    def train_ranks(self) -> tuple[int, ...]:
        return (dist.get_rank() if dist.is_initialized() else 0,)

    @property
    def sharded_state(self) -> bool:
        return False

    @property
    def captures_hidden(self) -> bool:
        return True

    # ---- forward ------------------------------------------------------------------
    def _token_logprobs(self, model: DecoderLM, mb: MicroBatch, batch: Sequence[Sequence2],
                        on_hidden: HiddenSink | None, capture_layers: tuple[int, ...] | None = None
                        ) -> torch.Tensor:
        if on_hidden is not None and capture_layers:
            hidden, captured = model.hidden_capture(mb.input_ids, capture_layers)
            _emit_hidden(on_hidden, join_features(hidden, captured), mb, batch)
        else:
            hidden = model.hidden(mb.input_ids)
            if on_hidden is not None:
                _emit_hidden(on_hidden, hidden, mb, batch)
        logits = model.logits(hidden)[:, :-1].float() / self.temperature
        if mb.input_ids.shape[1] == 1:  # a lone token has no target; keep shapes aligned
            return logits.new_zeros(mb.mask.shape)
        return token_logprobs(logits, mb.input_ids[:, 1:])

    @torch.no_grad()
    def logprobs(self, batch: Sequence[Sequence2], current: bool = True, *, on_hidden: HiddenSink | None = None,
                 capture_layers: tuple[int, ...] | None = None, part: int | None = None
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """See ``PolicyBackend.logprobs``; ``part`` (the pipelined update): only the sequences of
        that micro-batch of ``batch`` get values, the others None."""
        capture_layers = check_capture_layers("TorchPolicy.logprobs", capture_layers, self.model_config.num_layers)
        if not current and self.reference is None:
            return None, None
        mbs = self._micro_batches(batch, part)
        old = None
        if current:
            old = scatter([self._token_logprobs(self.model, mb, batch, on_hidden, capture_layers) for mb in mbs],
                          mbs, len(batch))
        ref = None
        if self.reference is not None:
            ref = scatter([self._token_logprobs(self.reference, mb, batch, None) for mb in mbs], mbs, len(batch))
        return old, ref

    # ---- update ----------------------------------------------------------------------
    def _micro_loss(self, mb: MicroBatch, batch: Sequence[Sequence2], advantages: torch.Tensor,
                    logp_old: list[torch.Tensor] | None, logp_ref: list[torch.Tensor] | None,
                    on_hidden: HiddenSink | None, capture_layers: tuple[int, ...] | None,
                    on_logprobs: LogprobSink | None, counted: torch.Tensor | None
                    ) -> tuple[torch.Tensor, dict[str, float], float]:
        """One micro-batch's loss (its token mean over counted sequences), its token-mean stats
        and its counted token count."""
        idx = mb.index.tolist()
        new = self._token_logprobs(self.model, mb, batch, on_hidden, capture_layers)
        if on_logprobs is not None:
            _emit_logprobs(on_logprobs, new, mb)
        old = new.detach() if logp_old is None else padded([logp_old[i].to(mb.mask) for i in idx], mb.mask)
        ref = None if logp_ref is None else padded([logp_ref[i].to(mb.mask) for i in idx], mb.mask)
        mask = counted_mask(mb, counted)
        loss, pg, kl, stats = policy_and_kl_loss(self.algorithm, new, old, advantages[mb.index], mask,
                                                 self.config.clip_eps, ref, self.config.kl_coef)
        means = {"pg_loss": float(pg.detach()), "kl": 0.0 if kl is None else float(kl.detach()),
                 "clip_frac": stats["clip_frac"], "approx_kl": stats["approx_kl"], "loss": float(loss.detach())}
        return loss, means, float(mask.sum())

    def update(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
               logp_ref: list[torch.Tensor] | None, global_tokens: int, *, on_hidden: HiddenSink | None = None,
               capture_layers: tuple[int, ...] | None = None, on_logprobs: LogprobSink | None = None,
               counted: torch.Tensor | None = None) -> dict[str, float]:
        check_update_args("TorchPolicy", batch, advantages, global_tokens, counted)
        capture_layers = check_capture_layers("TorchPolicy.update", capture_layers, self.model_config.num_layers)
        self.master.zero_grads()
        totals = dict.fromkeys(STATS, 0.0)
        advantages = advantages.to(self.device)
        for mb in micro_batches(batch, self.config.micro_batch, self.device, self.config.micro_batch_tokens):
            loss, means, n_local = self._micro_loss(mb, batch, advantages, logp_old, logp_ref, on_hidden,
                                                    capture_layers, on_logprobs, counted)
            # micro-batch token mean -> its share of the global token mean
            (loss * (n_local / global_tokens)).backward()
            for k in STATS:  # (x * n) / g, not x * (n / g): the logged stats keep their exact bits
                totals[k] += means[k] * n_local / global_tokens
        self.master.grads_to_masters()
        allreduce_flat([p.grad for p in self.master.masters])
        return {**totals, **self._step()}

    def _step(self) -> dict[str, float]:
        """Clip the masters' reduced gradients, step, round back into the parameters."""
        masters = self.master.masters
        clip = self.config.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(masters, clip if clip > 0 else float("inf"))
        lr = self.schedule.apply(self.step)
        self.optimizer.step()
        self.master.masters_to_params()
        self.step += 1
        return {"grad_norm": float(norm), "lr": lr}

    # ---- the pipelined update (policy.pipelined_update) ------------------------------------
    def begin_accumulation(self, token_budget: int) -> None:
        """Start a step whose gradient comes in terms (``accumulate``), summed in fixed point
        (``nemo_tlt.policy.fixed_point``); ``token_budget`` bounds the step's response tokens."""
        self._sums = FixedPointGrads(self.master.masters, token_budget)

    def accumulate(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
                   logp_ref: list[torch.Tensor] | None, *, on_hidden: HiddenSink | None = None,
                   capture_layers: tuple[int, ...] | None = None, on_logprobs: LogprobSink | None = None,
                   part: int | None = None, counted: torch.Tensor | None = None) -> dict[str, float]:
        """Add one term (one GRPO group) to the step's gradient: each of its micro-batches
        (``micro_batches`` of ``batch`` alone, so they depend on the term's tokens only; with
        ``part``, that micro-batch alone) adds the gradient of its token-sum loss over the
        token budget. Returns the term's token sums of ``STATS`` and its ``tokens``; the
        weights do not change."""
        if getattr(self, "_sums", None) is None:
            raise RuntimeError("TorchPolicy.accumulate: call begin_accumulation first")
        check_update_args("TorchPolicy", batch, advantages, 1, counted)
        capture_layers = check_capture_layers("TorchPolicy.accumulate", capture_layers, self.model_config.num_layers)
        sums = dict.fromkeys((*STATS, "tokens"), 0.0)
        advantages = advantages.to(self.device)
        for mb in self._micro_batches(batch, part):
            self.master.zero_grads(set_to_none=True)  # one micro-batch's gradient alone: nothing to add to
            loss, means, n_local = self._micro_loss(mb, batch, advantages, logp_old, logp_ref, on_hidden,
                                                    capture_layers, on_logprobs, counted)
            (loss * (n_local / self._sums.token_budget)).backward()
            self.master.grads_to_masters()
            self._sums.add([m.grad for m in self.master.masters], int(n_local))
            for k in STATS:
                sums[k] += means[k] * n_local
            sums["tokens"] += n_local
        return sums

    def num_parts(self, batch: Sequence[Sequence2]) -> int:
        """The micro-batches (``part`` values) of a term made of ``batch``."""
        lengths = [len(p) + len(r) for p, r in batch]
        return len(plan_micro_batches(lengths, self.config.micro_batch, self.config.micro_batch_tokens))

    def _micro_batches(self, batch: Sequence[Sequence2], part: int | None) -> list[MicroBatch]:
        mbs = micro_batches(batch, self.config.micro_batch, self.device, self.config.micro_batch_tokens)
        if part is None:
            return mbs
        if not 0 <= part < len(mbs):
            raise ValueError(f"TorchPolicy: part {part} of a batch of {len(mbs)} micro-batches")
        return [mbs[part]]

    def apply_accumulated(self, global_tokens: int) -> dict[str, float]:
        """Sum the terms over every rank (exact), scale to the token mean over
        ``global_tokens`` and take the one optimizer step; returns ``grad_norm`` and ``lr``."""
        sums, self._sums = getattr(self, "_sums", None), None
        if sums is None:
            raise RuntimeError("TorchPolicy.apply_accumulated: call begin_accumulation first")
        if global_tokens < 1:
            raise ValueError(f"TorchPolicy.apply_accumulated: global_tokens must be >= 1, got {global_tokens}")
        sums.reduce()
        for master, grad in zip(self.master.masters, sums.result(sums.token_budget / global_tokens)):
            master.grad = grad.to(master.device)
        return self._step()

    # ---- the training state during the rollout (rollout.training_state=offload) ---------------
    def offload_training_state(self) -> None:
        """See ``OffloadsTrainingState``; the rollout engine serves its own copy of the weights."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        reference = list(self.reference.parameters()) if self.reference is not None else []
        self._host.offload([*self.model.parameters(), *self.master.masters, *state, *reference],
                           drop=[p.grad for p in (*self.params, *self.master.masters)])

    def reload_training_state(self) -> None:
        self._host.reload()

    # ---- weights and state --------------------------------------------------------------
    def canonical_weights(self, rollout_tp: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """The replica's own weights, whole at any ``rollout_tp`` (the engine keeps its slice)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def load_canonical(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights), strict=True)
        self.master.params_to_masters()

    def state_dict(self) -> dict:
        """The optimizer state, the schedule step and (bf16 weights) the fp32 master weights."""
        return {"optimizer": self.optimizer.state_dict(), "step": self.step, "master": self.master.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step = int(state.get("step", 0))  # checkpoints without it predate the LR schedule
        self.master.load_state_dict(state.get("master"))  # absent in checkpoints of fp32-only versions


def _emit_logprobs(on_logprobs: LogprobSink, logprobs: torch.Tensor, mb: MicroBatch) -> None:
    """Each sequence's response-token log-probs of a micro-batch (detached), in batch indices."""
    values = logprobs.detach()
    for row, i in enumerate(mb.index.tolist()):
        on_logprobs(i, values[row][mb.mask[row].bool()])


def _emit_hidden(on_hidden: HiddenSink, hidden: torch.Tensor, mb: MicroBatch, batch: Sequence[Sequence2]) -> None:
    """Each real sequence's rows of a right-padded micro-batch, in batch indices."""
    hidden = hidden.detach().float()
    for row, i in enumerate(mb.index.tolist()):
        length = len(batch[i][0]) + len(batch[i][1])
        on_hidden(i, mb.input_ids[row, :length], hidden[row, :length])
