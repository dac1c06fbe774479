"""The plain-PyTorch policy backend: a `DecoderLM`, AdamW, log-probs recomputed by the policy.

Contract
--------
* A rollout batch is a list of ``(prompt, response)`` token lists. Sequences are
  right-padded (the model is causal, so padding never changes a real token's
  logits) into micro-batches of ``micro_batch`` sequences, sorted by length so
  little compute goes to padding. The order depends only on the tokens, so two
  runs that generated the same tokens compute bit-identical log-probs and updates.
* Log-probs are those of the sampling distribution: ``log_softmax(logits / T)`` at
  the response positions (the EOS a response ended with included).
* ``update`` minimises the GRPO loss as a *global* token mean: each micro-batch
  contributes ``sum(per-token loss) / global_tokens``, so summing gradients over
  data-parallel ranks (``reduce_grads``, e.g. a gloo all-reduce) gives exactly the
  gradient of the token mean over the whole step's batch. Clipping and the AdamW
  step then run identically on every rank, which keeps the replicas equal.
* With ``kl_coef > 0`` a frozen copy of the initial policy is the KL reference.
* ``update`` makes exactly one optimizer step, after all micro-batches, so the
  policy that generated the batch is the one being differentiated: with
  ``logp_old=None`` the old log-probs are the update forward's own, detached (ratio
  exactly 1), and no separate log-prob pass is needed.
* Nothing here is distributed or random; the RL loop owns both.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rl.grpo import clipped_pg_loss, kl_penalty, token_logprobs

Sequence2 = tuple[Sequence[int], Sequence[int]]  # (prompt tokens, response tokens)


@dataclass(frozen=True)
class PolicyConfig:
    lr: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    micro_batch: int = 8
    betas: tuple[float, float] = (0.9, 0.99)

    def __post_init__(self) -> None:
        check_float("PolicyConfig.lr", self.lr, 0, lo_open=True)
        for name in ("weight_decay", "grad_clip", "kl_coef"):
            check_float(f"PolicyConfig.{name}", getattr(self, name), 0)
        check_float("PolicyConfig.clip_eps", self.clip_eps, 0, 1, lo_open=True, hi_open=True)
        check_float("PolicyConfig.temperature", self.temperature, 0, lo_open=True)
        check_int("PolicyConfig.micro_batch", self.micro_batch, 1)


@dataclass
class MicroBatch:
    index: torch.Tensor       # [b] positions of these sequences in the rollout batch
    input_ids: torch.Tensor   # [b, T]
    mask: torch.Tensor        # [b, T-1] 1 where target input_ids[:, 1:] is a response token


def micro_batches(batch: Sequence[Sequence2], size: int) -> list[MicroBatch]:
    """Length-sorted, right-padded micro-batches covering every sequence once."""
    if not batch:
        raise ValueError("micro_batches: the rollout batch is empty")
    lengths = [len(p) + len(r) for p, r in batch]
    # Stable sort on (length, index): deterministic for a given set of tokens.
    order = sorted(range(len(batch)), key=lambda i: (lengths[i], i))
    out = []
    for start in range(0, len(order), size):
        idx = order[start: start + size]
        T = max(lengths[i] for i in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        mask = torch.zeros(len(idx), max(T - 1, 1), dtype=torch.float32)
        for row, i in enumerate(idx):
            prompt, response = batch[i]
            seq = list(prompt) + list(response)
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            # target j (= input_ids[j + 1]) is a response token for j in [P-1, P+R-1)
            mask[row, len(prompt) - 1: len(seq) - 1] = 1.0
        out.append(MicroBatch(torch.tensor(idx), ids, mask))
    return out


def _scatter(values: list[torch.Tensor], mbs: list[MicroBatch], n: int) -> list[torch.Tensor]:
    """Per-sequence response log-probs in rollout-batch order."""
    out: list[torch.Tensor | None] = [None] * n
    for mb, lp in zip(mbs, values):
        for row, i in enumerate(mb.index.tolist()):
            out[i] = lp[row][mb.mask[row].bool()]
    return out  # type: ignore[return-value]


class PolicyTrainer:
    """Holds the trainable policy, its optimizer and the optional KL reference."""

    def __init__(self, model: DecoderLM, config: PolicyConfig) -> None:
        self.model = model
        self.config = config
        self.model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, foreach=False)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    def _token_logprobs(self, model: DecoderLM, mb: MicroBatch) -> torch.Tensor:
        logits = model(mb.input_ids)[:, :-1] / self.config.temperature
        if mb.input_ids.shape[1] == 1:  # a lone token has no target; keep shapes aligned
            return logits.new_zeros(mb.mask.shape)
        return token_logprobs(logits, mb.input_ids[:, 1:])

    @torch.no_grad()
    def logprobs(self, batch: Sequence[Sequence2], current: bool = True
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Response log-probs under the current policy (None unless `current`) and the
        reference (None without one), per sequence."""
        if not current and self.reference is None:
            return None, None
        mbs = micro_batches(batch, self.config.micro_batch)
        old = _scatter([self._token_logprobs(self.model, mb) for mb in mbs], mbs, len(batch)) if current else None
        ref = None
        if self.reference is not None:
            ref = _scatter([self._token_logprobs(self.reference, mb) for mb in mbs], mbs, len(batch))
        return old, ref

    def update(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
               logp_ref: list[torch.Tensor] | None, global_tokens: int,
               reduce_grads: Callable[[list[torch.Tensor]], None] | None = None) -> dict[str, float]:
        """One optimizer step of the clipped PG loss (+ KL) as a token mean over
        ``global_tokens`` response tokens of all ranks; ``logp_old=None``: this
        forward's own log-probs, detached (see the module contract)."""
        if advantages.shape != (len(batch),):
            raise ValueError(f"PolicyTrainer.update: advantages must be [{len(batch)}], got {tuple(advantages.shape)}")
        if global_tokens < 1:
            raise ValueError(f"PolicyTrainer.update: global_tokens must be >= 1, got {global_tokens}")
        self.optimizer.zero_grad(set_to_none=False)
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
        for mb in micro_batches(batch, self.config.micro_batch):
            idx = mb.index.tolist()
            new = self._token_logprobs(self.model, mb)
            old = new.detach() if logp_old is None else _padded([logp_old[i] for i in idx], mb.mask)
            pg, stats = clipped_pg_loss(new, old, advantages[mb.index], mb.mask, self.config.clip_eps)
            n_local = float(mb.mask.sum())
            loss = pg
            if logp_ref is not None:
                kl = kl_penalty(new, _padded([logp_ref[i] for i in idx], mb.mask), mb.mask)
                loss = loss + self.config.kl_coef * kl
                totals["kl"] += float(kl.detach()) * n_local / global_tokens
            # micro-batch token mean -> share of the global token mean
            (loss * (n_local / global_tokens)).backward()
            totals["loss"] += float(loss.detach()) * n_local / global_tokens
            totals["pg_loss"] += float(pg.detach()) * n_local / global_tokens
            totals["clip_frac"] += stats["clip_frac"] * n_local / global_tokens
            totals["approx_kl"] += stats["approx_kl"] * n_local / global_tokens
        grads = [p.grad for p in self.params]
        if reduce_grads is not None:
            reduce_grads(grads)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip if self.config.grad_clip > 0
                                              else float("inf"))
        self.optimizer.step()
        return {**totals, "grad_norm": float(norm)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


def _padded(rows: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence response values back into the [b, T-1] layout of `mask`."""
    out = torch.zeros_like(mask)
    for r, values in enumerate(rows):
        out[r][mask[r].bool()] = values
    return out
