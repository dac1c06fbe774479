"""The megatron-core policy backend: a TP x PP ``GPTModel`` behind the ``PolicyBackend`` contract.

Contract: ``PolicyBackend`` (``nemo_tlt.policy.protocol``), plus
* Built on *every* rank of an initialised ``torch.distributed`` world (gloo on CPU, NCCL
  on GPU) of size TP x PP x data-parallel; the launcher owns the world. It initialises
  megatron's parallel state (or checks the existing one), builds this rank's real
  ``GPTModel`` (CPU shims around every call only on CPU, megatron's random initialisation
  skipped) and loads its shard of the canonical (HF-named) weights, given as a state dict
  or as a ``CanonicalSource`` such as the lazily read HF folder
  (``nemo_tlt.weights.hf_source.SafetensorsFolder``): this rank reads only its own slices,
  once, in the weights dtype, and copies them into its weights tensor by tensor
  (``nemo_tlt.weights.megatron_source``), so it never holds the full model nor a second
  copy of its shard. The KL reference copies the policy's freshly loaded weights.
* The same length-sorted micro-batches as the torch backend; log-probs of
  ``log_softmax(logits / T)`` over the *true* vocabulary (Megatron's padded rows masked
  out). Every rank of a model-parallel group passes the same batch (checked); results
  come back on every rank.
* Data parallelism and the optimizer are megatron-core's own (``nemo_tlt.megatron.ddp_optimizer``):
  the model is wrapped in ``DistributedDataParallel`` (fp32 grad buffers) and stepped by
  megatron's ``DistributedOptimizer`` (fp32 main params for bf16 weights, fp32 Adam state,
  both sharded over the data-parallel group). After the micro-batches' backward passes
  ``finalize_model_grads`` reduce-scatters the gradients over DP (summed: the loss is each
  micro-batch's share of the step's global token mean), sums tied embeddings over the first
  and last stage under PP > 1 and sequence-parallel norms over TP; the optimizer's step clips
  by the global norm (every weight counted once) and runs AdamW (decay on every weight, as the
  torch backend). The learning rate follows ``nemo_tlt.optim``'s schedule, set on each of the
  optimizer's param groups before each step.
* ``policy.sequence_parallel`` and ``policy.recompute`` go into the ``TransformerConfig``
  (``nemo_tlt.megatron.gpt_builder.Training``); under sequence parallelism every forward pads
  its sequence to a multiple of TP (right padding: causal, so no real token sees it) and the
  logits are cut back. The layer spec is Transformer Engine's where it is importable and the
  policy is on a GPU, the local spec otherwise (logged at build). Sequence parallelism needs
  Transformer Engine's spec (the local spec's norm refuses it): refused before any collective
  where the local spec would be built (on CPU, so it is not tested here).
* ``captures_hidden`` is True: a hook on the final norm (``megatron_patches.hidden_capture``)
  captures the hidden states of the log-prob / update forward on the last stage; with
  ``capture_layers`` hooks on those decoder layers capture them on the stages holding them
  (``nemo_tlt.megatron.forward_features``). With PP > 1 each is broadcast from its stage to
  every stage of the pipeline, so ``on_hidden`` runs on every rank with the whole feature.
* Weights out: ``canonical_weights(rollout_tp)`` yields the canonical weights on every rank,
  tensor by tensor as the slice-only reshard (``nemo_tlt.weights.reshard.iter_reshard``)
  delivers them: whole at ``rollout_tp`` 1, else each rank's rollout slices only, so no
  rank holds a copy of the model beside the one its consumer builds (a collective: every
  rank consumes the stream to its end).
  ``rollout_state_dict(rollout_tp, receivers)`` collects a rollout engine's TP shard
  (each receiver receives only its slice); ``canonical_state_dict()`` gathers on global rank 0.
* Sharded checkpoints: ``save_sharded(dir)`` / ``load_sharded(dir)`` (collective) write and
  read this rank's slices of the weights and the distributed optimizer's state (its own
  ``sharded_state_dict``) through megatron-core's ``dist_checkpointing``
  (``nemo_tlt.megatron.policy_checkpoint``); another data-parallel size loads, another TP / PP
  where the padded vocabulary agrees. ``start_save_sharded(dir)`` writes from forked processes
  while the caller goes on; a load, and on the CPU the next optimizer step, first wait for
  those writers (``finish_writes``), so the only host pages rewritten while they share the
  rank's memory are the forward and backward passes'. ``state_dict()`` is this rank's exact optimizer shard
  (for a run checkpoint at the same layout).
* ``OffloadsTrainingState`` (``rollout.training_state=offload``): the DDP parameter and gradient
  buffers through megatron-core's own offload calls, the distributed optimizer's state and fp32
  main params and the KL reference through ``HostOffload``, in place
  (``nemo_tlt.megatron.ddp_optimizer.offload_training_state``); per rank, no collective.
"""
from __future__ import annotations

import importlib.util
import logging
import time
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from nemo_tlt.algorithms.grpo import GRPO
from nemo_tlt.algorithms.protocol import RLAlgorithm
from nemo_tlt.device import Placement
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.offload import HostOffload
from nemo_tlt.optim import LRSchedule
from nemo_tlt.policy.batching import MicroBatch, Sequence2, micro_batches, scatter
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.policy.megatron_checks import batch_digest, check_policy_model, check_policy_spec, policy_layout
# megatron-core is imported inside these functions, so importing them here costs nothing
from nemo_tlt.policy.megatron_forward import policy_loss_fn, run_schedule, vocab_parallel_logprobs
from nemo_tlt.policy.protocol import STATS, HiddenSink, LogprobSink, check_capture_layers, check_update_args
from nemo_tlt.weights.sources import CanonicalSource, MappingSource

log = logging.getLogger(__name__)


class MegatronPolicy:
    """One rank's policy shard in megatron's DDP, its distributed optimizer + schedule and the
    optional frozen KL reference; ``algorithm``'s ``policy_loss`` is the loss (None: GRPO's)."""

    def __init__(self, canonical: Mapping[str, torch.Tensor] | CanonicalSource, model_config: LMConfig,
                 config: PolicyConfig, *, temperature: float, seed: int, placement: Placement = Placement(),
                 algorithm: RLAlgorithm | None = None) -> None:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise RuntimeError("policy.backend=megatron needs megatron-core, which is not installed; install it "
                               "with pip install -e \".[megatron]\" (or pip install megatron-core)")
        from nemo_tlt.megatron.parallel import default_backend

        if not temperature > 0:
            raise ValueError(f"MegatronPolicy: temperature must be > 0, got {temperature!r}")
        check_policy_model(config, model_config)  # before any collective: a bad TP fails alike on every rank
        from nemo_tlt.megatron.gpt_builder import layer_spec_name

        check_policy_spec(config, layer_spec_name(placement.device.type), placement.device.type)
        if not dist.is_initialized():
            raise RuntimeError("policy.backend=megatron needs an initialised torch.distributed world "
                               f"(backend {default_backend()!r}); the launcher (nemo_tlt.dist / torchrun / SLURM) "
                               "owns it")
        self._model_config, self.config, self.temperature, self.seed = model_config, config, temperature, seed
        self.algorithm = GRPO() if algorithm is None else algorithm
        self.layout = policy_layout(config)
        self.dtype = placement.dtype
        self.device = placement.device
        from nemo_tlt.megatron.ddp_optimizer import build_ddp_optimizer
        from nemo_tlt.megatron.gpt_builder import Training

        self.spec = layer_spec_name(self.device.type)
        log.info("megatron policy: %s layer spec (TP=%d, PP=%d, sequence_parallel=%s, recompute=%s)", self.spec,
                 self.layout.tp, self.layout.pp, config.sequence_parallel, config.recompute)
        with self._device_context():
            from nemo_tlt.megatron.parallel import ensure_model_parallel

            ensure_model_parallel(self.layout.tp, self.layout.pp, seed=seed, owner="policy")
            source = canonical if isinstance(canonical, CanonicalSource) else MappingSource(canonical)
            self.model = self._build(source, Training(config.sequence_parallel, config.recompute, True)).train()
            self.reference = None
            if config.kl_coef > 0:
                self.reference = self._build(None, Training(config.sequence_parallel)).eval().requires_grad_(False)
            self.ddp, self.optimizer = build_ddp_optimizer(self.model, config.optim, self.dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.schedule = LRSchedule(self.optimizer, config.optim)
        self.step = 0
        self._writing = None  # the PendingPolicySave of a start_save_sharded not waited for yet
        self._host = HostOffload(self.device)

    # ---- the contract's properties -------------------------------------------------
    @property
    def model_config(self) -> LMConfig:
        return self._model_config

    @property
    def train_ranks(self) -> tuple[int, ...]:
        from megatron.core import parallel_state

        if not self.model_parallel:
            return (dist.get_rank(),)
        return tuple(dist.get_process_group_ranks(parallel_state.get_model_parallel_group()))

    @property
    def sharded_state(self) -> bool:
        """The optimizer state differs per rank: split over TP x PP and, by the distributed
        optimizer, over data-parallel replicas."""
        return dist.get_world_size() > 1

    @property
    def model_parallel(self) -> bool:
        return self.layout.tp * self.layout.pp > 1

    @property
    def captures_hidden(self) -> bool:
        return True

    @property
    def coords(self) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank) of this process."""
        from nemo_tlt.megatron.live import rank_coords

        return rank_coords()

    # ---- set-up -------------------------------------------------------------------------
    def _device_context(self):
        from nemo_tlt.megatron.parallel import device_context

        return device_context(self.device)

    def _build(self, source: CanonicalSource | None, training) -> torch.nn.Module:
        """This rank's GPTModel holding its shard of ``source``, or (None) a copy of ``self.model``'s weights."""
        from nemo_tlt.megatron.gpt_builder import build_gpt_model
        from nemo_tlt.megatron.live import load_shard_items, local_shard, rank_coords
        from nemo_tlt.weights.megatron_source import megatron_shard_items

        model = build_gpt_model(self.model_config, self.layout, dtype=self.dtype, training=training, spec=self.spec,
                                initialize=False)
        items = (local_shard(self.model).items() if source is None else
                 megatron_shard_items(source, self.model_config, self.layout, rank_coords(), self.dtype))
        load_shard_items(model, items, self.spec)
        return model.to(self.device)

    # ---- forward pieces ------------------------------------------------------------------
    def _token_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(logits, input_ids, self.temperature, self.model_config.vocab_size)

    def _schedule(self, model: torch.nn.Module, mb: MicroBatch, loss_fn: Callable, forward_only: bool,
                  batch: Sequence[Sequence2], on_hidden: HiddenSink | None,
                  capture_layers: tuple[int, ...] | None = None) -> list:
        return run_schedule(model, mb, loss_fn, forward_only, batch, on_hidden, capture_layers, device=self.device,
                            layout=self.layout, sequence_parallel=self.config.sequence_parallel,
                            model_config=self.model_config, last_stage=self._is_last_stage())

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

        if not self.model_parallel:
            return
        group = parallel_state.get_model_parallel_group()
        digests: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, batch_digest(batch), group=group)
        if len(set(digests)) != 1:
            raise ValueError("MegatronPolicy: the ranks of one model-parallel group passed different batches; "
                             "every rank of policy.train_ranks must pass the union of their rollouts")

    # ---- log-probs -----------------------------------------------------------------------
    def _all_logprobs(self, model: torch.nn.Module, batch: Sequence[Sequence2], mbs: list[MicroBatch],
                      on_hidden: HiddenSink | None, capture_layers: tuple[int, ...] | None = None
                      ) -> list[torch.Tensor]:
        values = []
        for mb in mbs:
            ids = mb.input_ids.to(self.device)
            out = self._schedule(model, mb, lambda o, non_loss_data=True, ids=ids: self._token_logprobs(o, ids),
                                 True, batch, on_hidden, capture_layers)
            values.append(out[0] if self._is_last_stage() else None)
        lengths = [len(r) for _, r in batch]
        flat = (torch.cat(scatter([v.float().cpu() for v in values], mbs, len(batch))).to(self.device)
                if self._is_last_stage() else torch.empty(sum(lengths), device=self.device))
        return list(self._from_last_stage(flat).split(lengths))

    @torch.no_grad()
    def logprobs(self, batch: Sequence[Sequence2], current: bool = True, *, on_hidden: HiddenSink | None = None,
                 capture_layers: tuple[int, ...] | None = None
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        capture_layers = check_capture_layers("MegatronPolicy.logprobs", capture_layers,
                                              self.model_config.num_layers)
        if not current and self.reference is None:  # nothing to compute: no batch check (a collective)
            return None, None
        mbs = micro_batches(batch, self.config.micro_batch)
        with self._device_context():
            self._check_same_batch(batch)
            old = None
            if current:
                self.model.eval()
                old = self._all_logprobs(self.model, batch, mbs, on_hidden, capture_layers)
                self.model.train()
            ref = None
            if self.reference is not None:
                ref = self._all_logprobs(self.reference, batch, mbs, None)
        return old, ref

    # ---- update --------------------------------------------------------------------------
    def update(self, batch: Sequence[Sequence2], advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
               logp_ref: list[torch.Tensor] | None, global_tokens: int, *, on_hidden: HiddenSink | None = None,
               capture_layers: tuple[int, ...] | None = None, on_logprobs: LogprobSink | None = None,
               counted: torch.Tensor | None = None) -> dict[str, float]:
        from nemo_tlt.megatron.ddp_optimizer import zero_grads

        check_update_args("MegatronPolicy", batch, advantages, global_tokens, counted)
        capture_layers = check_capture_layers("MegatronPolicy.update", capture_layers, self.model_config.num_layers)
        with self._device_context():
            self._check_same_batch(batch)
            zero_grads(self.ddp, self.optimizer)
            totals = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
            for mb in micro_batches(batch, self.config.micro_batch):
                self._schedule(self.ddp, mb, self._loss_fn(mb, advantages, logp_old, logp_ref, global_tokens,
                                                             totals, on_logprobs, counted), False, batch, on_hidden,
                               capture_layers)
            self._from_last_stage(totals)
            norm, lr = self._optimizer_step()
        return {**dict(zip(STATS, totals.tolist())), "grad_norm": norm, "lr": lr}

    def _optimizer_step(self) -> tuple[float, float]:
        """On the gradients in the DDP buffers: the schedule's lr, megatron's step (gradients
        finalised and clipped, Adam step, weights from the main params); returns (grad norm, lr)."""
        from nemo_tlt.megatron.ddp_optimizer import finish_step

        lr = self.schedule.apply(self.step)
        if self.device.type == "cpu":  # the step rewrites the host pages the writers share
            self.finish_writes()
        with self._device_context():
            norm = finish_step(self.ddp, self.optimizer)
        self.step += 1
        return norm, lr

    def _loss_fn(self, mb: MicroBatch, advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
                 logp_ref: list[torch.Tensor] | None, global_tokens: int, totals: torch.Tensor,
                 on_logprobs: LogprobSink | None = None, counted: torch.Tensor | None = None) -> Callable:
        return policy_loss_fn(mb, advantages, logp_old, logp_ref, global_tokens, totals, on_logprobs,
                              device=self.device, token_logprobs=self._token_logprobs, algorithm=self.algorithm,
                              clip_eps=self.config.clip_eps, kl_coef=self.config.kl_coef, counted=counted)

    # ---- the training state during the rollout (rollout.training_state=offload) ---------------
    def offload_training_state(self) -> None:
        """See ``OffloadsTrainingState``; the rollout engine serves its own copy of the weights."""
        from nemo_tlt.megatron.ddp_optimizer import offload_training_state

        reference = list(self.reference.parameters()) if self.reference is not None else []
        offload_training_state(self.ddp, self.optimizer, self._host, reference)

    def reload_training_state(self) -> None:
        from nemo_tlt.megatron.ddp_optimizer import reload_training_state

        reload_training_state(self.ddp, self._host)

    # ---- weights out / in ----------------------------------------------------------------
    def canonical_weights(self, rollout_tp: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """The canonical weights on every rank, one tensor at a time, as the reshard delivers them
        (a collective: every rank must consume the stream to its end): whole, or at ``rollout_tp``
        > 1 only rank r's rollout slices (TP rank r % rollout_tp: a rollout replica is that many
        consecutive ranks)."""
        from nemo_tlt.megatron.live import local_shard
        from nemo_tlt.weights.reshard import ReshardPlan, iter_reshard

        plan = ReshardPlan(self.model_config, self.layout, rollout_tp, dtype=self.dtype, device=self.device.type)
        stream = iter_reshard(local_shard(self.model), plan)
        while True:
            # the CPU shims are on only while the reshard runs, never while the consumer does
            with self._device_context():
                item = next(stream, None)
            if item is None:
                return
            yield item

    def canonical_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every rank calls; global rank 0 gets the gathered canonical weights, the others None."""
        from nemo_tlt.megatron.live import gather_canonical

        with self._device_context():
            return gather_canonical(self.model, self.model_config, self.layout)

    def rollout_state_dict(self, rollout_tp: int = 1, receivers: tuple[int, ...] = ()
                           ) -> dict[str, torch.Tensor] | None:
        """Stream the weights, layer by layer, to ``receivers`` (default every rank) in the rollout
        engine's layout at ``rollout_tp`` (canonical names); None on non-receivers."""
        from nemo_tlt.megatron.live import local_shard
        from nemo_tlt.weights.reshard import ReshardPlan, stream_reshard

        plan = ReshardPlan(self.model_config, self.layout, rollout_tp, receivers=receivers, dtype=self.dtype,
                           device=self.device.type)
        with self._device_context():
            return stream_reshard(local_shard(self.model), plan)

    def load_canonical(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy weights (e.g. on resume); the KL reference keeps the initial policy."""
        from nemo_tlt.megatron.live import load_shard_items
        from nemo_tlt.weights.megatron_source import megatron_shard_items

        items = megatron_shard_items(MappingSource(weights), self.model_config, self.layout, self.coords, self.dtype)
        self.finish_writes()
        load_shard_items(self.model, items, self.spec)
        with self._device_context():
            self.optimizer.reload_model_params()  # the fp32 main params follow the new weights

    # ---- sharded checkpoints ---------------------------------------------------------------
    def _sharded_state(self, is_loading: bool) -> dict:
        from nemo_tlt.megatron.policy_checkpoint import layout_common, policy_sharded_state

        common = layout_common(self.model_config, self.layout, self.dtype, self.step)
        return policy_sharded_state(self.model, self.optimizer, common, is_loading)

    def save_sharded(self, directory: str) -> None:
        """Collective: every rank writes its own shard of the weights and of the distributed
        optimizer's state (fp32 main params, Adam moments) into ``directory`` (megatron-core
        ``dist_checkpointing``; nothing gathered on any rank)."""
        from nemo_tlt.megatron.policy_checkpoint import save_policy_shards

        self.finish_writes()  # one save at a time: its results server is the process's only one
        with self._device_context():
            save_policy_shards(self._sharded_state(False), directory)

    def start_save_sharded(self, directory: str):
        """``save_sharded``, asynchronous (collective): returns a ``PendingPolicySave`` whose
        ``wait()`` (collective) completes the checkpoint; the shard files are written meanwhile
        (``nemo_tlt.megatron.policy_checkpoint.start_policy_save``)."""
        from nemo_tlt.megatron.policy_checkpoint import start_policy_save

        self.finish_writes()
        with self._device_context():
            state = self._sharded_state(False)
        self._writing = start_policy_save(state, directory, self._device_context)
        return self._writing

    def finish_writes(self) -> None:
        """Collective: wait for the last ``start_save_sharded``'s writers (its ``wait()``). Called
        before a load, and before the optimizer step where the state lives in host memory: the
        forked writers share the rank's pages copy-on-write, so a step while they live would copy
        the whole state; waiting bounds a checkpoint's extra memory to what the forward and
        backward passes write (``nemo-tlt bench checkpoint``), at the cost of the wait when the
        write outlasts the rollout and passes before the step (logged). On a GPU the writers
        write a host copy made before the fork and the step rewrites device memory: no wait."""
        if self._writing is None:
            return
        pending, self._writing = self._writing, None
        t0 = time.perf_counter()
        pending.wait()
        waited = time.perf_counter() - t0
        if waited > 0.05:
            log.info("policy step %d waited %.2f s for the checkpoint writers", self.step, waited)

    def load_sharded(self, directory: str) -> None:
        """Collective: this rank's slice of a ``save_sharded`` checkpoint, written at any data-parallel
        size (and TP / PP where the padded vocabulary agrees; refused otherwise, naming both)."""
        from nemo_tlt.megatron.policy_checkpoint import COMMON, load_policy_shards, restore_policy_shards

        self.finish_writes()
        with self._device_context():
            loaded = load_policy_shards(self._sharded_state(True), directory)
            restore_policy_shards(self.model, self.optimizer, loaded)
        self.step = int(loaded[COMMON]["step"])

    def state_dict(self) -> dict:
        """This rank's optimizer shard (exact: Adam moments, step, fp32 main params of bf16 weights)
        and schedule step, tagged with its (pp, tp) and data-parallel rank and size."""
        from nemo_tlt.megatron.ddp_optimizer import local_state

        return {"optimizer": local_state(self.optimizer), "step": self.step, **self._state_coords()}

    def _state_coords(self) -> dict:
        from megatron.core import parallel_state

        return {"coords": list(self.coords), "tensor_parallel": self.layout.tp,
                "pipeline_parallel": self.layout.pp, "data_parallel": parallel_state.get_data_parallel_world_size(),
                "data_parallel_rank": parallel_state.get_data_parallel_rank(), "dtype": str(self.dtype)}

    def load_state_dict(self, state: dict) -> None:
        from nemo_tlt.megatron.ddp_optimizer import load_local_state

        mine = self._state_coords()
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"MegatronPolicy.load_state_dict: a state of {theirs} cannot be loaded on {mine} (the "
                             "distributed optimizer's shard of one rank; save_sharded / load_sharded reshard)")
        self.finish_writes()
        with self._device_context():
            load_local_state(self.optimizer, state["optimizer"])
        self.step = int(state["step"])
