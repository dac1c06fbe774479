"""The megatron-core policy backend: a TP x PP ``GPTModel`` with the interface of ``PolicyTrainer``.

Contract
--------
* Built on *every* rank of an initialised ``torch.distributed`` world (gloo on CPU,
  NCCL on GPU: ``default_backend()``) of size TP x PP x data-parallel. It initialises
  megatron's parallel state (or checks the existing one), builds this rank's real
  ``GPTModel`` (local spec, no Transformer Engine; CPU shims around every call only on
  CPU) and loads its shard of the canonical (HF-named) weights via the layout adapters.
* ``logprobs`` / ``update`` / ``state_dict`` / ``load_state_dict`` mean what they mean
  for ``nemo_tlt.rl.policy.PolicyTrainer``: the same length-sorted micro-batches,
  log-probs of ``log_softmax(logits / T)`` over the *true* vocabulary (Megatron's
  padded rows masked out), the GRPO loss as a global token mean (each micro-batch adds
  ``sum(loss) / global_tokens``). Every rank of a model-parallel group passes the same
  batch (checked); results come back on every rank. ``reduce_grads`` sums over
  data-parallel replicas: pass ``allreduce_data_parallel_grads``.
* Gradients: without sequence parallelism megatron's local-spec layers keep the
  residual stream replicated over TP (row-parallel outputs all-reduced in forward,
  column-parallel inputs all-reduce their grad in backward), so replicated norms get
  identical grads on every TP rank with no extra all-reduce. Tied embeddings under
  PP > 1 (two copies, first and last stage) are summed here over the embedding group,
  as megatron's ``finalize_model_grads`` would. The clip norm counts every weight once
  and is all-reduced over the model-parallel group.
* Optimizer: ``torch.optim.AdamW`` over the local shards (elementwise, so sharded ==
  unsharded for equal grads). Megatron's ``DistributedOptimizer`` (fp32 main params,
  grad buffers, overlapped reduce) needs its DDP wrapper; not used here.
* Weights out: ``canonical_state_dict()`` gathers on global rank 0;
  ``rollout_state_dict(rollout_tp)`` streams layer by layer to every rank (or
  ``receivers``) in the rollout engine's layout, for ``load_policy_weights``.
* ``logprobs(batch, on_hidden=f)`` hands each sequence's final hidden states (after
  the final norm, ``[L, H]``) to ``f(index, tokens, hidden)`` from the same forward, on
  the last pipeline stage (where every TP rank holds them in full).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from nemo_tlt.checks import check_int
from nemo_tlt.model.config import LMConfig
from nemo_tlt.rl.grpo import clipped_pg_loss, kl_penalty
from nemo_tlt.rl.policy import MicroBatch, PolicyConfig, Sequence2, _padded, _scatter, micro_batches
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import canonical_to_megatron, check_tp

HiddenSink = Callable[[int, torch.Tensor, torch.Tensor], None]  # (batch index, tokens [L], hidden [L, H])
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_STATS = ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")


def default_backend() -> str:
    """The process-group backend megatron needs here: NCCL on GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class MegatronPolicyConfig:
    """TP / PP sizes of the policy (world = TP x PP x data-parallel); weights dtype ('float32' |
    'bfloat16'); Megatron's vocab padding multiple; seed of megatron's RNG tracker."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    dtype: str = "float32"
    make_vocab_size_divisible_by: int = 128
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "make_vocab_size_divisible_by"):
            check_int(f"MegatronPolicyConfig.{name}", getattr(self, name), 1)
        if self.dtype not in _DTYPES:
            raise ValueError(f"MegatronPolicyConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tensor_parallel, pp=self.pipeline_parallel,
                              make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)

    def check_model(self, cfg: LMConfig) -> None:
        """Refuse a TP that cannot split heads / query groups / MLP, or a PP the layers cannot fill."""
        try:
            check_tp(cfg, self.tensor_parallel)
        except ValueError as err:
            raise ValueError(f"MegatronPolicyConfig.tensor_parallel={self.tensor_parallel}: {err}") from None
        if self.pipeline_parallel > cfg.num_layers:
            raise ValueError(f"MegatronPolicyConfig.pipeline_parallel={self.pipeline_parallel} exceeds "
                             f"num_layers={cfg.num_layers}: every stage needs at least one layer")
        try:
            self.layout.stage_layer_counts(cfg.num_layers)
        except ValueError as err:
            raise ValueError(f"MegatronPolicyConfig.pipeline_parallel={self.pipeline_parallel}: {err}") from None


def _batch_digest(batch: Sequence[Sequence2]) -> str:
    return hashlib.sha256(repr([(list(p), list(r)) for p, r in batch]).encode()).hexdigest()


class MegatronPolicyTrainer:
    """One rank's policy shard, its AdamW and the optional frozen KL reference. See the module docstring."""

    def __init__(self, canonical: Mapping[str, torch.Tensor], model_config: LMConfig, config: PolicyConfig,
                 parallel: MegatronPolicyConfig) -> None:
        parallel.check_model(model_config)  # before any collective: a bad TP fails the same on every rank
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicyTrainer needs an initialised torch.distributed world "
                               f"(backend {default_backend()!r}); the launcher (torchrun / SLURM / run_gloo) owns it")
        self.model_config, self.config, self.parallel = model_config, config, parallel
        self.layout = parallel.layout
        self.dtype = _DTYPES[parallel.dtype]
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        with self._device_context():
            self._init_parallel_state()
            self.model = self._build(canonical).train()
            self.reference = None
            if config.kl_coef > 0:
                self.reference = self._build(canonical).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, foreach=False)

    @classmethod
    def from_hf_folder(cls, path: str, config: PolicyConfig, parallel: MegatronPolicyConfig
                       ) -> "MegatronPolicyTrainer":
        from nemo_tlt.model.hf_io import read_config, read_state_dict

        cfg = read_config(path)
        state = read_state_dict(path)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return cls(state, cfg, config, parallel)

    # ---- set-up -------------------------------------------------------------------------
    def _device_context(self) -> contextlib.AbstractContextManager:
        """CPU shims only on CPU: on a GPU they would silently move training off it."""
        if self.device.type == "cpu":
            from megatron_patches.cpu_shims import cpu_shims

            return cpu_shims()
        return contextlib.nullcontext()

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state

        from megatron_patches.cpu_shims import init_model_parallel

        tp, pp = self.layout.tp, self.layout.pp
        if not parallel_state.model_parallel_is_initialized():
            init_model_parallel(tp, pp, seed=self.parallel.seed)
            return
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"MegatronPolicyConfig asks for TP={tp}, PP={pp} but megatron's parallel state "
                             f"is already initialised with TP={have[0]}, PP={have[1]}")

    def _build(self, canonical: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        from megatron_patches.gpt_builder import build_gpt_model
        from nemo_tlt.weights.megatron_live import load_shard, rank_coords

        model = build_gpt_model(self.model_config, self.layout, dtype=self.dtype)
        shard = canonical_to_megatron(canonical, self.model_config, self.layout)[rank_coords()]
        load_shard(model, {k: v.to(self.dtype) for k, v in shard.items()})
        return model.to(self.device)

    @property
    def coords(self) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank) of this process."""
        from nemo_tlt.weights.megatron_live import rank_coords

        return rank_coords()

    # ---- forward pieces ------------------------------------------------------------------
    def _token_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """log softmax(logits / T) at the next tokens, from vocab-parallel logits ``[B, T, V/tp]``."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if input_ids.shape[1] == 1:  # a lone token has no target; keep the graph for backward
            return logits.sum(-1) * 0.0
        scaled = (logits[:, :-1].float() / self.config.temperature).contiguous()
        part = scaled.shape[-1]
        valid = self.model_config.vocab_size - parallel_state.get_tensor_model_parallel_rank() * part
        if valid < part:
            # Megatron pads the vocabulary with zero rows; their logit 0 would join the partition
            # function, so they get probability exactly 0 (and no gradient) instead.
            pad = torch.arange(part, device=scaled.device) >= max(valid, 0)
            scaled = scaled.masked_fill(pad, float("-inf"))
        # The megatron op subtracts the max in place: it gets a tensor nobody else reads.
        return -vocab_parallel_cross_entropy(scaled, input_ids[:, 1:].contiguous())

    def _schedule(self, model: torch.nn.Module, mb: MicroBatch, loss_fn: Callable, forward_only: bool) -> list:
        """Megatron's own schedule (pipelined for PP > 1) over one micro-batch.

        One schedule call per micro-batch because micro-batches have different lengths
        and the pipeline's point-to-point buffers are shaped per call.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_patches.cpu_shims import causal_attention_mask

        ids = mb.input_ids.to(self.device)
        B, T = ids.shape
        positions = torch.arange(T, device=self.device).unsqueeze(0).expand(B, T)
        mask = causal_attention_mask(T, B).to(self.device)

        def forward_step(data_iterator: Iterator, step_model: torch.nn.Module):
            return step_model(next(data_iterator), positions, mask), loss_fn

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=T, micro_batch_size=B, forward_only=forward_only, collect_non_loss_data=forward_only)

    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast a last-stage tensor to every stage of this rank's pipeline (shape known everywhere)."""
        from megatron.core import parallel_state

        if self.layout.pp > 1:
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return tensor

    def _check_same_batch(self, batch: Sequence[Sequence2]) -> None:
        from megatron.core import parallel_state

        if self.layout.tp * self.layout.pp == 1:
            return
        group = parallel_state.get_model_parallel_group()
        digests: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, _batch_digest(batch), group=group)
        if len(set(digests)) != 1:
            raise ValueError("MegatronPolicyTrainer: the ranks of one model-parallel group passed different "
                             "batches; broadcast the batch within the TP x PP group first")

    # ---- log-probs -----------------------------------------------------------------------
    def _all_logprobs(self, model: torch.nn.Module, batch: Sequence[Sequence2], mbs: list[MicroBatch],
                      on_hidden: HiddenSink | None) -> list[torch.Tensor]:
        from megatron_patches.hidden_capture import HiddenCapture

        current: list[MicroBatch] = []

        def emit(hidden: torch.Tensor) -> None:
            mb = current[-1]
            for row, i in enumerate(mb.index.tolist()):
                length = len(batch[i][0]) + len(batch[i][1])
                on_hidden(i, mb.input_ids[row, :length], hidden[row, :length])

        capture = HiddenCapture(model, emit) if on_hidden is not None else None
        values = []
        try:
            for mb in mbs:
                current.append(mb)
                ids = mb.input_ids.to(self.device)
                out = self._schedule(model, mb, lambda o, non_loss_data=True: self._token_logprobs(o, ids), True)
                values.append(out[0] if self._is_last_stage() else None)
        finally:
            if capture is not None:
                capture.remove()
        lengths = [len(r) for _, r in batch]
        flat = (torch.cat(_scatter([v.float().cpu() for v in values], mbs, len(batch))).to(self.device)
                if self._is_last_stage() else torch.empty(sum(lengths), device=self.device))
        return list(self._from_last_stage(flat).split(lengths))

    @torch.no_grad()
    def logprobs(self, batch: Sequence[Sequence2], current: bool = True, *, on_hidden: HiddenSink | None = None
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Response log-probs under the current policy (None unless `current`) and the
        reference (None without one), per sequence, on every rank."""
        if not current and self.reference is None:  # nothing to compute: no batch check (a collective)
            return None, None
        mbs = micro_batches(batch, self.config.micro_batch)
        with self._device_context():
            self._check_same_batch(batch)
            old = None
            if current:
                self.model.eval()
                old = self._all_logprobs(self.model, batch, mbs, on_hidden)
                self.model.train()
            ref = None
            if self.reference is not None:
                ref = self._all_logprobs(self.reference, batch, mbs, None)
        return old, ref

    # ---- update --------------------------------------------------------------------------
    def update(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
               logp_ref: list[torch.Tensor] | None, global_tokens: int,
               reduce_grads: Callable[[list[torch.Tensor]], None] | None = None) -> dict[str, float]:
        """One AdamW step of the clipped PG loss (+ KL) as a token mean over ``global_tokens``;
        ``logp_old=None``: the loss forward's own log-probs, detached (one step per batch)."""
        if advantages.shape != (len(batch),):
            raise ValueError(f"MegatronPolicyTrainer.update: advantages must be [{len(batch)}], "
                             f"got {tuple(advantages.shape)}")
        if global_tokens < 1:
            raise ValueError(f"MegatronPolicyTrainer.update: global_tokens must be >= 1, got {global_tokens}")
        with self._device_context():
            self._check_same_batch(batch)
            self.optimizer.zero_grad(set_to_none=False)
            for p in self.params:
                if p.grad is None:  # a weight megatron's graph never reached still joins the reduce
                    p.grad = torch.zeros_like(p)
            totals = torch.zeros(len(_STATS), dtype=torch.float64, device=self.device)
            for mb in micro_batches(batch, self.config.micro_batch):
                self._schedule(self.model, mb, self._loss_fn(mb, advantages, logp_old, logp_ref,
                                                             global_tokens, totals), False)
            self._from_last_stage(totals)
            grads = [p.grad for p in self.params]
            self._allreduce_tied_embedding_grads()
            if reduce_grads is not None:
                reduce_grads(grads)
            norm = self._clip_grads()
            self.optimizer.step()
        return {**dict(zip(_STATS, totals.tolist())), "grad_norm": norm}

    def _loss_fn(self, mb: MicroBatch, advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
                 logp_ref: list[torch.Tensor] | None, global_tokens: int, totals: torch.Tensor) -> Callable:
        """The last stage's loss for one micro-batch; accumulates the step stats into ``totals``."""
        idx = mb.index.tolist()
        mask = mb.mask.to(self.device)
        ids = mb.input_ids.to(self.device)
        old = None if logp_old is None else _padded([logp_old[i].to(mask) for i in idx], mask)
        ref = _padded([logp_ref[i].to(mask) for i in idx], mask) if logp_ref is not None else None
        adv = advantages[mb.index].to(mask)
        share = float(mb.mask.sum()) / global_tokens

        def loss_fn(output: torch.Tensor, non_loss_data: bool = False):
            new = self._token_logprobs(output, ids)
            pg, stats = clipped_pg_loss(new, new.detach() if old is None else old, adv, mask, self.config.clip_eps)
            loss, kl = pg, None
            if ref is not None:
                kl = kl_penalty(new, ref, mask)
                loss = loss + self.config.kl_coef * kl
            parts = (loss.detach(), pg.detach(), kl.detach() if kl is not None else 0.0,
                     stats["clip_frac"], stats["approx_kl"])
            totals.add_(torch.tensor([float(v) for v in parts], dtype=torch.float64, device=totals.device) * share)
            # micro-batch token mean -> its share of the global token mean
            return loss * share, {}

        return loss_fn

    # ---- gradients ------------------------------------------------------------------------
    def _allreduce_tied_embedding_grads(self) -> None:
        """Tied embeddings under PP > 1 live on the first and the last stage; their grads are summed."""
        from megatron.core import parallel_state

        if not (self.model_config.tie_word_embeddings and self.layout.pp > 1):
            return
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            return
        weight = self.model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _clip_grads(self) -> float:
        """Clip by the global grad norm over every weight counted once; returns the norm."""
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.params:
            duplicate = (not getattr(p, "tensor_model_parallel", False) and tp_rank != 0) or getattr(p, "shared", False)
            if not duplicate:
                sq += p.grad.float().pow(2).sum()
        if self.layout.tp * self.layout.pp > 1:
            dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = sq.sqrt()
        if self.config.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so both backends clip alike.
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            for p in self.params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    def allreduce_data_parallel_grads(self, grads: list[torch.Tensor]) -> None:
        """Sum gradients over the data-parallel replicas (pass as ``reduce_grads``)."""
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    # ---- weights out / in ----------------------------------------------------------------
    def canonical_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every rank calls; global rank 0 gets the gathered canonical weights, the others None."""
        from nemo_tlt.weights.megatron_live import gather_canonical

        with self._device_context():
            return gather_canonical(self.model, self.model_config, self.layout)

    def rollout_state_dict(self, rollout_tp: int = 1, receivers: tuple[int, ...] = ()
                           ) -> dict[str, torch.Tensor] | None:
        """Stream the weights, layer by layer, to ``receivers`` (default every rank) in the rollout
        engine's layout at ``rollout_tp`` (canonical names); None on non-receivers."""
        from nemo_tlt.weights.megatron_live import local_shard
        from nemo_tlt.weights.reshard import ReshardPlan, stream_reshard

        plan = ReshardPlan(self.model_config, self.layout, rollout_tp, receivers=receivers, dtype=self.dtype,
                           device=self.device.type)
        with self._device_context():
            return stream_reshard(local_shard(self.model), plan)

    def load_canonical(self, canonical: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy weights (e.g. on resume); the KL reference keeps the initial policy."""
        from nemo_tlt.weights.megatron_live import load_shard

        shard = canonical_to_megatron(canonical, self.model_config, self.layout)[self.coords]
        with torch.no_grad():
            load_shard(self.model, {k: v.to(self.device, self.dtype) for k, v in shard.items()})

    def state_dict(self) -> dict:
        """This rank's optimizer state (over its own shard), tagged with its (pp, tp) coordinates."""
        return {"optimizer": self.optimizer.state_dict(), "coords": list(self.coords),
                "tensor_parallel": self.layout.tp, "pipeline_parallel": self.layout.pp}

    def load_state_dict(self, state: dict) -> None:
        mine = (list(self.coords), self.layout.tp, self.layout.pp)
        theirs = (list(state["coords"]), state["tensor_parallel"], state["pipeline_parallel"])
        if mine != theirs:
            raise ValueError(f"MegatronPolicyTrainer.load_state_dict: state of (coords, TP, PP)={theirs} "
                             f"cannot be loaded on {mine}")
        self.optimizer.load_state_dict(state["optimizer"])
