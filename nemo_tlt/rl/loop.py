"""The GRPO loop with TLT, as run by every rank (SPMD), in its six phases.

One RL step on every rank:
1. ``rollout``: the step's prompts come from the task source, seeded by (seed, step);
   rollout replica q (``rollout.tensor_parallel`` consecutive ranks, one rank by default:
   ``nemo_tlt.rl.rollout_replicas``) takes the prompts p with p % replicas == q, G samples
   each (whole groups, so advantages stay local), and its engine, tensor-parallel over the
   replica's ranks, decodes them, speculating as the run's SD policy decides (TLT; the
   replica leader's policy) or plainly (baseline).
2. ``idle_time``: a rank whose share is done marks itself IDLE; with TLT it trains
   the drafter on harvested hidden states until the last rank finishes, then all
   ranks meet and average the drafter, which the engine loads.
3. ``score``: rewards of the decoded responses, group advantages.
4. ``update_policy``: the policy backend's log-probs and one optimizer step of the
   GRPO loss (a global token mean; the backend reduces gradients over its replicas).
5. ``sync_weights``: the backend's canonical weight stream goes to the rollout
   engine (and the drafter's view of the target).
6. ``log_and_checkpoint``: rank 0 logs the step and checkpoints (async); a policy whose
   state is sharded over ranks (the megatron backend) is checkpointed by every rank
   together instead, each writing its own shard (``nemo_tlt.rl.sharded_run_checkpoint``).

The loop sees three contracts only: ``RolloutEngine``, ``PolicyBackend`` and the task.
Prompts, sampling seed and sequence ids are functions of (seed, step), so with
``coupled`` or ``greedy`` acceptance TLT and baseline generate the same tokens, rewards
and weights, and a resumed run repeats the steps an uninterrupted one takes.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from nemo_tlt.algorithms.protocol import Advantages, Outcomes, counted_kwarg
from nemo_tlt.algorithms.registry import build_algorithm
from nemo_tlt.device import Placement, torch_dtype
from nemo_tlt.dist import build_node_groups, gather_topology
from nemo_tlt.drafter.base import CapturesLayers
from nemo_tlt.policy.factory import build_policy_backend
from nemo_tlt.policy.protocol import PipelinedAccumulation, ShardedCheckpoints, require
from nemo_tlt.rl.boundary import StepBoundary
from nemo_tlt.rl.decode_segments import decode_segments
from nemo_tlt.rl.harvest_rows import InOrderHarvest
from nemo_tlt.rl.idle_drafter import IdleDrafter, idle_without_training
from nemo_tlt.rl.logprob_gap import comparable, gap_sums
from nemo_tlt.rl.policy_inputs import load_policy_inputs
from nemo_tlt.rl.pipelined_step import PipelinedStep
from nemo_tlt.rl.records import IdleResult, RankState, RankStep, Rollout, arm_accept_counts, step_record
from nemo_tlt.rl.report import MetricsWriter, progress_bar
from nemo_tlt.rl.rollout_replicas import RolloutReplicas, by_replica, rollout_tp_group, training_share
from nemo_tlt.rl.run import RunSpec, step_rng, step_seed
from nemo_tlt.rl.run_checkpoint import RunCheckpointer, RunState, restore
from nemo_tlt.rl.sharded_run_checkpoint import ShardedRunCheckpointer, rank_state_for, restore_sharded
from nemo_tlt.rl.task import build_task, check_eos, check_vocab
from nemo_tlt.rl.validation import is_due, validate, validation_prompts, validation_sampling
from nemo_tlt.rl.weight_stream import WeightStream
from nemo_tlt.rollout.factory import build_rollout_engine
from nemo_tlt.rollout.protocol import Request, RequestResult
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.spot.coordinator import WorkerCoordinator

if TYPE_CHECKING:
    from nemo_tlt.dist import Comm, StopFlag

log = logging.getLogger(__name__)


class RLWorker:
    """One rank's state across RL steps. See the module docstring."""

    def __init__(self, spec: RunSpec, comm: "Comm", stop: "StopFlag") -> None:
        cfg = self.cfg = spec.config
        self.spec, self.comm, self.stop = spec, comm, stop
        # every component of this rank lives on the device the launcher bound, in the run's dtype
        placement = Placement(comm.device, torch_dtype(cfg.model.dtype))
        # the folder's config and lazily read weights: the policy backend reads its own shard
        # (megatron: this rank's slices only), the drafter's view its three tensors; no copy here
        inputs = load_policy_inputs(spec.target_dir)
        model_config = inputs.model_config
        self.task = build_task(cfg.task, spec.target_dir)
        self.validation_prompts = validation_prompts(cfg) if cfg.validation.every > 0 else []
        check_vocab(self.task.tokenizer, model_config.vocab_size, spec.target_dir)
        check_eos(self.task.tokenizer, model_config.eos_token_id, spec.target_dir)
        self.algorithm = build_algorithm(cfg.algorithm, cfg.algorithm_options)
        self.policy = build_policy_backend(cfg.policy, inputs.weights, model_config,
                                           temperature=cfg.grpo.temperature, seed=cfg.seed, placement=placement,
                                           algorithm=self.algorithm)
        # rollout replicas: consecutive ranks whose engine is tensor-parallel over them (collective)
        self.replicas = RolloutReplicas(comm.rank, comm.world, cfg.rollout.tensor_parallel)
        self.share = training_share(comm.gather(self.policy.train_ranks), comm.rank, self.replicas.tp)
        self.engine_tp = rollout_tp_group(self.replicas)
        self.sd_policy = self.drafter = None
        if spec.tlt:
            self.sd_policy = cfg.rollout.build_policy(np.random.default_rng([cfg.seed, comm.rank, 0xB4]))
            view = inputs.target_view(placement)
            # collective (every rank builds a TLT worker): the drafter average goes through node leaders
            nodes = build_node_groups(gather_topology(comm), comm.rank, cfg.workers.timeout_s)
            self.drafter = IdleDrafter(cfg.drafter, spec.drafter_dir, view, comm.rank, cfg.seed, nodes,
                                       placement=placement)
        # the requests of one rollout: this replica's whole groups
        batch = len(self.replicas.prompts(cfg.grpo.prompts_per_step)) * cfg.grpo.group_size
        self.engine = build_rollout_engine(cfg.rollout, spec.target_dir, placement, tp=self.engine_tp,
                                           drafter=self.drafter.drafter if self.drafter else None, max_batch=batch)
        if self.drafter is not None:
            self.engine.load_drafter(self.drafter.drafter)
        self.harvest_from = cfg.drafter.harvest_from if self.drafter and cfg.drafter.train_on_idle else None
        if self.harvest_from == "policy" and not self.policy.captures_hidden:
            raise ValueError(f"drafter.harvest_from=policy: the {cfg.policy.backend} policy backend hands over no "
                             "hidden states; use drafter.harvest_from=rollout")
        # an EAGLE-3 drafter trains on its captured target layers and the final state, which the
        # policy's forward hands over in the rollout engine's layout when asked for them
        self.capture_layers = (self.drafter.drafter.capture_layers
                               if self.drafter and isinstance(self.drafter.drafter, CapturesLayers) else None)
        # the update pipelined into the rollout's tail (nemo_tlt.rl.pipelined_step)
        if cfg.policy.pipelined_update:
            require(self.policy, PipelinedAccumulation, cfg.policy.backend, "policy.pipelined_update=true")
        self.pipeline = (PipelinedStep(cfg, spec.mode, self.policy, comm, self.task,
                                       partial(self._harvest_sink, own=None) if self.harvest_from == "policy" else None,
                                       self.capture_layers, self.replicas, self.algorithm)
                         if cfg.policy.pipelined_update else None)
        self.coord = WorkerCoordinator(comm.store, comm.rank, comm.world, cfg.drafter.min_idle_workers,
                                       prefix=f"tlt/{spec.mode}", timeout_s=cfg.workers.timeout_s)
        # a sharded policy state is checkpointed by every rank (its shard); else rank 0 writes it all
        self.sharded = self.policy.sharded_state
        if self.sharded:
            require(self.policy, ShardedCheckpoints, cfg.policy.backend, "a sharded policy state (sharded_state)")
        self.ckpt = (ShardedRunCheckpointer(spec.checkpoint_dir, cfg.checkpoint.keep_last, comm.rank) if self.sharded
                     else RunCheckpointer(spec.checkpoint_dir, cfg.checkpoint.keep_last, writer=comm.rank == 0))
        # what the engine serves, kept for rank 0's checkpoints (none with shards: they hold the policy);
        # filled by every step's weight sync before a checkpoint is written
        self.synced: dict[str, torch.Tensor] = {}
        self.records: list[dict[str, Any]] = []
        self.policy_states: list[dict] = [] if self.sharded else [self.policy.state_dict()]
        self.rank_states: list[RankState] = []
        self.saved_step: int | None = None
        self.start_step = 0

    # ---- the run --------------------------------------------------------------
    def run(self, on_step: Callable | None = None) -> dict[str, Any]:
        t_run = time.perf_counter()
        self.t0 = self.coord.now()
        if self.cfg.resume:
            self.resume()
        status, step, rank0 = "completed", self.start_step, self.comm.rank == 0
        bar = progress_bar(self.cfg, self.spec.mode, self.start_step) if rank0 else None
        writer = (MetricsWriter(self.spec.out_dir, self.records, logger=self.cfg.logger, config=self.cfg.to_dict())
                  if rank0 else None)
        boundary = StepBoundary(self.comm, self.stop, self.cfg.workers.time_limit_margin_s)
        try:
            for step in range(self.start_step, self.cfg.steps):
                decision = boundary.decide()
                if decision.stop or decision.out_of_time:
                    status = "interrupted" if decision.stop else "time_limit"
                    break
                record = self.step(step, skip_drafter_round=decision.tight)
                check = self.validate(step)  # every rank (collective); after the sync: the updated policy
                if rank0:
                    record.update(time_left_s=boundary.time_left(), drafter_round_skipped=decision.tight)
                    boundary.budget.add_step(record["step_s"] + (check["validation_s"] if check else 0.0))
                t0 = time.perf_counter()
                self.log_and_checkpoint(step, record, writer, bar)  # every rank: a sharded save is collective
                if rank0:
                    if check is not None:
                        writer.write(check)
                    boundary.budget.add_checkpoint(time.perf_counter() - t0)
                if on_step is not None:
                    on_step(step, record)
            else:
                step = self.cfg.steps
            # every rank agreed on the stop, so every rank knows the last completed step (a
            # resumed run's first one, step - 1 = start_step - 1, is its checkpoint already)
            if status != "completed" and step > 0:
                self.checkpoint(step - 1, final=True)
                if rank0:
                    log.warning("%s: checkpoint of step %d in %s; continue with resume=true",
                                boundary.reason(decision), step - 1, self.spec.checkpoint_dir)
        finally:
            close_all(bar, writer, self.ckpt, self.drafter)
        self.close_engine()
        return {"mode": self.spec.mode, "status": status, "records": self.records, "next_step": step,
                "wall_s": time.perf_counter() - t_run, "out_dir": self.spec.out_dir,
                "checkpoint_dir": str(self.spec.checkpoint_dir)}

    def close_engine(self) -> None:
        """Release an engine that holds resources (``close``: vLLM's) once every rank is past
        its last collective on the engine's process groups (vLLM's are subgroups of the rank's
        default group, which it keeps)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            self.comm.barrier()
            close()

    def step(self, step: int, skip_drafter_round: bool = False) -> dict[str, Any]:
        comm, G = self.comm, self.cfg.grpo.group_size
        t_start = time.perf_counter()
        prompts = self.task.source.prompts(step, self.cfg.grpo.prompts_per_step, step_rng(self.cfg.seed, step))
        pipe = self.pipeline
        board = pipe.board(step) if pipe is not None and self.spec.tlt else None
        collector = pipe.collector(prompts, board) if pipe is not None else None
        rollout = self.rollout(step, prompts, collector)
        early, t_early = {}, 0.0  # pieces of the update (and their seconds of work) before the meet
        if board is not None:  # the update's pieces while other ranks still decode, then idle
            early, segments, t_early = pipe.claim(step, board, self.coord.now)
            rollout.segments.extend(segments)
        idle = self.idle_time(step, skip_drafter_round)
        t_meet = time.perf_counter()
        timeline = self.coord.collect_timelines(step) if comm.rank == 0 else []
        self.coord.mark_busy()
        rewards = collector.rewards(rollout.ids) if collector is not None else self.score(prompts, rollout)
        if pipe is not None:
            update, t_update, t_work = pipe.finish(step, collector, rollout, early, board is None)
            t_logprob, t_work = 0.0, t_work + t_early
        else:
            batch = [(req.prompt, r.tokens) for req, r in zip(rollout.requests, rollout.out.results)]
            gen_logprobs = [r.logprobs for r in rollout.out.results]  # the logprob_gap metric's generation side
            update, t_logprob, t_update = self.update_policy(step, batch, rewards, gen_logprobs)
            t_work = t_logprob + t_update
        t0 = time.perf_counter()
        weights, policy_digest, t_digest = self.sync_weights(idle, self.cfg.debug.digest_at(step, self.cfg.steps - 1))
        t_sync = time.perf_counter() - t0
        # a replica's rollout is counted once, its leader's (every member decoded the same tokens)
        stats, lead = rollout.out.stats, self.replicas.leader
        mine = RankStep(rank=comm.rank, node=comm.node, ids=rollout.ids if lead else [],
                        tokens=[r.tokens for r in rollout.out.results] if lead else [],
                        rewards=rewards if lead else [], gen_s=rollout.seconds,
                        sd_steps=stats.sd_steps if lead else 0, plain_steps=stats.plain_steps if lead else 0,
                        accept_lengths=stats.accept_lengths if lead else [],
                        segments=rollout.segments, idle=idle,
                        update=update, state=self.rank_state(), weights=weights,
                        arm_accept=arm_accept_counts(stats.trace) if lead else {},
                        update_work_s=t_work, policy_digest=policy_digest,
                        prompt_tokens=sum(len(req.prompt) for req in rollout.requests) if lead else 0)
        ranks = comm.gather(mine)
        # a sharded policy state (the megatron backend on more than one rank) stays where it is:
        # each rank writes its own shard at the checkpoint (ShardedRunCheckpointer)
        if not self.sharded:
            self.policy_states = [self.policy.state_dict()]
        if comm.rank != 0:
            return {}
        if board is not None and step >= 2:  # every rank is past step - 2 (the gather above)
            pipe.cleanup(step - 2)
        self.rank_states = [r.state for r in ranks]
        times = {"step_s": time.perf_counter() - t_start, "rollout_s": t_meet - t_start, "logprob_s": t_logprob,
                 "update_s": t_update, "weight_sync_s": t_sync, "weight_digest_s": t_digest}
        return step_record(step, self.spec.mode, self.cfg.grpo.prompts_per_step * G, ranks, times, timeline,
                           self.t0, self.coord.now())

    # ---- the phases -----------------------------------------------------------
    def rollout(self, step: int, prompts: list, on_finish: Callable | None = None) -> Rollout:
        cfg, G = self.cfg, self.cfg.grpo.group_size
        ids = [p * G + g for p in self.replicas.prompts(len(prompts)) for g in range(G)]
        requests = [Request(self.task.tokenizer.encode(prompts[i // G].text, add_bos=True), seq_id=i) for i in ids]
        sampling = SamplingParams(cfg.grpo.acceptance, temperature=cfg.grpo.temperature,
                                  max_new_tokens=cfg.grpo.max_new_tokens, seed=step_seed(cfg.seed, step))
        t0, t_gen = time.perf_counter(), self.coord.now()
        if on_finish is not None:
            on_finish.bind(requests, ids)
        harvest = None
        if self.harvest_from == "rollout":
            self.drafter.buffer.advance_step(step)
            harvest = InOrderHarvest(requests, partial(self.drafter.sample, step), self.drafter.buffer.add_sample)
            on_finish = _then(on_finish, harvest.take)
        out = self.engine.generate(requests, sampling, policy=self.sd_policy, return_hidden=harvest is not None,
                                   on_finish=on_finish)
        seconds = time.perf_counter() - t0
        if harvest is not None:
            harvest.finish(out.results)
        segments = decode_segments(out.stats.trace, out.stats.prefill_s, out.stats.wall_s, t_gen)
        return Rollout(ids, requests, out, segments, seconds)

    def idle_time(self, step: int, skip: bool = False) -> IdleResult:
        """This rank's share is done: train the drafter until every rank is (TLT), meet.
        ``skip`` (agreed by every rank) only meets."""
        if self.harvest_from is None or skip:
            return idle_without_training(self.coord, step)
        return self.drafter.idle_time(step, self.coord)

    def validate(self, step: int) -> dict[str, Any] | None:
        """The validation record of this step (rank 0) when one is due (``validation.every``)."""
        if not is_due(self.cfg.validation, step):
            return None
        return validate(self.engine, self.task, self.validation_prompts, validation_sampling(self.cfg, step), step,
                        self.spec.mode, comm=self.comm, replicas=self.replicas)

    def score(self, prompts: list, rollout: Rollout) -> list[float]:
        G, task = self.cfg.grpo.group_size, self.task
        return [float(task.reward(prompts[i // G], task.tokenizer.decode(r.tokens)))
                for i, r in zip(rollout.ids, rollout.out.results)]

    def update_policy(self, step: int, batch: list, rewards: list[float], gen_logprobs: list | None = None
                      ) -> tuple[dict[str, float], float, float]:
        """Log-probs and one optimizer step on this rank's training share of the step's rollouts
        (``nemo_tlt.rl.rollout_replicas.training_share``); with ``gen_logprobs`` (this rank's
        rollout's) the logprob_gap sums go into the update's dict (one member per replica reports)."""
        replicas, share, G = self.replicas, self.share, self.cfg.grpo.group_size
        # every response token the algorithm counts, once (each replica's leader counts its rollout)
        counted = replicas.counted_tokens(self.advantages(batch, rewards).tokens)
        # (at least 1: a step whose every sequence is dropped steps on a zero gradient)
        global_tokens = max(1, int(self.comm.sum_(torch.tensor([float(counted)], device="cpu")).item()))
        # the rollouts this rank's model replica trains on (nemo_tlt.rl.rollout_replicas)
        shares = (by_replica(self.comm.gather((batch, rewards)), replicas.tp, share.replicas)
                  if len(share.replicas) > 1 else {replicas.replica: (batch, rewards)})
        if gen_logprobs is not None and share.parts > 1:
            gen_logprobs = [gen_logprobs[i] for i in share.indices(len(batch), G)]
        batch, rewards, own = share.select(shares, replicas.replica, G)
        if share.parts == 1 and not replicas.leader:
            gen_logprobs = None  # the leader reports the replica's logprob_gap sums
        on_hidden = self._harvest_sink(step, own) if self.harvest_from == "policy" else None
        t0 = time.perf_counter()
        logp_old, logp_ref = self.policy.logprobs(batch, self.cfg.policy.separate_logprob_pass)
        t_logprob, t0 = time.perf_counter() - t0, time.perf_counter()
        advantages = self.advantages(batch, rewards)
        # health metric (nemo_tlt.rl.logprob_gap): the policy's log-probs of this rank's own
        # sequences, from the separate pass or else from the update forward (before its step)
        policy_lp: dict[int, torch.Tensor] = {}
        wanted = gen_logprobs is not None and comparable(self.cfg.grpo.acceptance, self.cfg.grpo.temperature)
        sink = policy_lp.__setitem__ if wanted and logp_old is None else None
        update = self.policy.update(batch, advantages.values, logp_old, logp_ref, global_tokens, on_hidden=on_hidden,
                                    capture_layers=self.capture_layers if on_hidden is not None else None,
                                    on_logprobs=sink, **counted_kwarg(advantages))
        if wanted and logp_old is not None:
            policy_lp = {i: logp_old[i] for i in own}
        if wanted and all(i in policy_lp for i in own):  # a megatron rank off the last stage has none
            update = {**update, **gap_sums(gen_logprobs, [policy_lp[i] for i in own])}
        return {**update, "loss_tokens": global_tokens}, t_logprob, time.perf_counter() - t0

    def advantages(self, batch: list, rewards: list[float]) -> Advantages:
        """The run's algorithm's advantages of whole groups (``batch``'s responses, ``rewards``)."""
        g = self.cfg.grpo
        return self.algorithm.advantages(Outcomes.of(rewards, [r for _, r in batch], g.group_size, g.max_new_tokens,
                                                     self.task.tokenizer.eos_id))

    def _harvest_sink(self, step: int, own: range | None) -> Callable:
        """Drafter data from the policy's own forward: this rank's sequences of the batch (None: all)."""
        self.drafter.buffer.advance_step(step)

        def on_hidden(index: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
            if own is None or index in own:
                self.drafter.harvest(step, tokens.tolist(), hidden[:-1])
        return on_hidden

    def sync_weights(self, idle: IdleResult, digest: bool) -> tuple[str | None, str | None, float]:
        """Policy weights to the engine and the drafter's view; new drafter weights to the
        engine. Returns, when ``digest``, the digest of both (replicas must stay identical) and of
        the policy alone (None otherwise), and the seconds spent hashing."""
        view = self.drafter.view if self.drafter is not None else None
        # at rollout TP > 1 a model-parallel policy sends each rank only its slices (slice-only sync)
        stream = WeightStream(self.policy.canonical_weights(rollout_tp=self.replicas.tp),
                              keep=self.comm.rank == 0 and not self.sharded, view=view, tp=self.engine_tp,
                              digest=digest)
        self.engine.load_policy_weights(stream)
        self.synced = stream.kept
        policy_digest = stream.hexdigest()
        if self.drafter is not None:
            t0 = time.perf_counter()
            self.engine.load_drafter(self.drafter.drafter)
            idle.drafter_sync_s = time.perf_counter() - t0
            if idle.drafter_steps and self.sd_policy is not None:
                self.sd_policy.drafter_updated()  # it discounts what it measured of the old drafter
            stream.add(self.drafter.drafter)
        return stream.hexdigest(), policy_digest, stream.digest_s

    def log_and_checkpoint(self, step: int, record: dict[str, Any], writer: MetricsWriter | None, bar) -> None:
        """Every rank: rank 0 (the one with a ``writer``) logs; the checkpoint is rank 0's or collective."""
        if writer is not None:
            self.records.append(record)
            writer.write(record)
        self.checkpoint(step, final=step == self.cfg.steps - 1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")

    # ---- checkpoints ------------------------------------------------------------------
    def rank_state(self) -> RankState:
        sd = self.sd_policy.state_dict() if self.sd_policy is not None else None
        gen = self.drafter.trainer.generator.get_state().tolist() if self.drafter is not None else None
        return RankState(sd, gen)

    def checkpoint(self, step: int, final: bool) -> None:
        """Called by every rank at the same point; the per-rank states were gathered on rank 0 at
        the end of the step. Unsharded: rank 0 writes (async). Sharded: collective, every rank
        writes its shard of the policy, rank 0 the rest, in one atomic commit."""
        if self.saved_step == step or (not final and (step + 1) % self.cfg.checkpoint.every):
            return
        if self.sharded or self.comm.rank == 0:
            d = self.drafter if self.comm.rank == 0 else None  # the drafter is identical on every rank
            state = RunState(step, self.spec.mode, self.comm.world, self.synced, self.policy_states,
                             self.rank_states, self.records,
                             d.drafter.state_dict() if d is not None else None,
                             d.trainer.state_dict() if d is not None else None)
            if self.sharded:
                self.ckpt.save(state, self.policy)
            else:
                self.ckpt.save(state)
        self.saved_step = step

    def resume(self) -> None:
        """Every rank reads the newest valid checkpoint of this run (if any) and restores from it."""
        state = self.ckpt.load_latest(self.comm.world, self.spec.mode)
        if state is None:
            log.info("resume=true but %s holds no checkpoint: starting at step 0", self.spec.checkpoint_dir)
            return
        if self.sharded:  # this rank's slice of the policy; the engine and view from its stream
            restore_sharded(state, self.comm.rank, self.policy, self.engine, self.sd_policy, self.drafter,
                            tp=self.engine_tp)
        else:
            restore(state, self.comm.rank, self.policy, self.engine, self.sd_policy, self.drafter)
            self.synced = dict(state.policy_weights)
        self.records = list(state.records) if self.comm.rank == 0 else []
        self.rank_states = [rank_state_for(state, r) for r in range(self.comm.world)]
        self.saved_step = state.step
        self.start_step = state.step + 1


def close_all(*closables: Any) -> None:
    """Close each (None skipped), every one even when one raises (a sharded checkpointer's
    close is collective and fails when a peer died); then re-raise the first error."""
    first: BaseException | None = None
    for closable in closables:
        if closable is None:
            continue
        try:
            closable.close()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others closed
            log.error("closing %s failed: %s", type(closable).__name__, err)
            first = first or err
    if first is not None:
        raise first


def run_rank(spec: RunSpec, comm: "Comm", stop: "StopFlag", on_step: Callable | None = None) -> dict[str, Any]:
    """Entry point of one rank (called by the launcher)."""
    return RLWorker(spec, comm, stop).run(on_step)


def _then(first: Callable | None, second: Callable) -> Callable:
    """An ``on_finish`` sink calling ``first`` (when given), then ``second``."""
    if first is None:
        return second

    def both(index: int, result: RequestResult) -> None:
        first(index, result)
        second(index, result)
    return both
