"""The RL loop with TLT, as run by every rank (SPMD): one step is rollout, idle time
(drafter training), scores and advantages, the policy update (synchronous:
``nemo_tlt.rl.update.sync_update``, or pipelined into the rollout's tail:
``nemo_tlt.rl.update.pipelined_step``), the weight sync, logging and checkpoints
(``nemo_tlt.rl.state.run_saver``); docs/architecture.md follows the data through one step.

The loop sees contracts only: ``RolloutEngine``, ``PolicyBackend``, ``RLAlgorithm`` and the
task. Prompts, sampling seed and sequence ids are functions of (seed, step), so with
``coupled`` or ``greedy`` acceptance TLT and baseline generate the same tokens, rewards
and weights, and a resumed run repeats the steps an uninterrupted one takes.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from nemo_tlt.algorithms.protocol import advantages_of
from nemo_tlt.algorithms.registry import build_algorithm
from nemo_tlt.device import Placement, torch_dtype
from nemo_tlt.dist import build_node_groups, gather_topology
from nemo_tlt.drafter.base import CapturesLayers
from nemo_tlt.policy.factory import build_policy_backend
from nemo_tlt.policy.protocol import PipelinedAccumulation, require
from nemo_tlt.rl.boundary import StepBoundary
from nemo_tlt.rl.idle_drafter import IdleDrafter, idle_without_training
from nemo_tlt.rl.policy_inputs import load_policy_inputs
from nemo_tlt.rl.update.pipelined_step import PipelinedStep
from nemo_tlt.rl.reporting.records import IdleResult, RankState, RankStep, Rollout, arm_accept_counts, step_record
from nemo_tlt.rl.reporting.report import MetricsWriter, progress_bar
from nemo_tlt.rl.rollout_replicas import RolloutReplicas, rollout_tp_group, training_share
from nemo_tlt.rl.run import RunSpec, step_rng
from nemo_tlt.rl.rollout_phase import rollout_phase
from nemo_tlt.rl.state.run_saver import RunSaver, close_all
from nemo_tlt.rl.update.sync_update import SyncUpdate
from nemo_tlt.rl.training_state import TrainingState
from nemo_tlt.rl.data.task import build_task, check_eos, check_vocab
from nemo_tlt.rl.data.validation import is_due, validate, validation_prompts, validation_sampling
from nemo_tlt.rl.weight_stream import sync_weights
from nemo_tlt.rollout.factory import build_rollout_engine
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
        self.task = build_task(cfg.task, spec.target_dir)
        self.validation_prompts = validation_prompts(cfg) if cfg.validation.every > 0 else []
        check_vocab(self.task.tokenizer, inputs.model_config.vocab_size, spec.target_dir)
        check_eos(self.task.tokenizer, inputs.model_config.eos_token_id, spec.target_dir)
        self.algorithm = build_algorithm(cfg.algorithm, cfg.algorithm_options)
        self.policy = build_policy_backend(cfg.policy, inputs.weights, inputs.model_config,
                                           temperature=cfg.grpo.temperature, seed=cfg.seed, placement=placement,
                                           algorithm=self.algorithm)
        # rollout replicas: consecutive ranks whose engine is tensor-parallel over them (collective)
        self.replicas = RolloutReplicas(comm.rank, comm.world, cfg.rollout.tensor_parallel)
        self.share = training_share(comm.gather(self.policy.train_ranks), comm.rank, self.replicas.tp)
        self.engine_tp = rollout_tp_group(self.replicas)
        self._build_rollout(inputs, placement)
        self.state = TrainingState(self.policy, cfg.rollout.training_state, cfg.policy.backend, self.engine)
        self._build_updates()
        self.coord = WorkerCoordinator(comm.store, comm.rank, comm.world, cfg.drafter.min_idle_workers,
                                       prefix=f"tlt/{spec.mode}", timeout_s=cfg.workers.timeout_s)
        # the run's checkpoints: every rank's shard of a sharded policy state, else rank 0's
        self.saver = RunSaver(spec, comm, self.policy)
        self.records: list[dict[str, Any]] = []
        self.start_step = 0

    def _build_rollout(self, inputs: Any, placement: Placement) -> None:
        """The SD policy and the idle-time drafter (TLT), the engine, and where drafter data comes from."""
        cfg, comm, spec = self.cfg, self.comm, self.spec
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
                                           drafter=self.drafter.served() if self.drafter else None, max_batch=batch)
        if self.drafter is not None:
            self.engine.load_drafter(self.drafter.served())
        self.harvest_from = cfg.drafter.harvest_from if self.drafter and cfg.drafter.train_on_idle else None
        if self.harvest_from == "policy" and not self.policy.captures_hidden:
            raise ValueError(f"drafter.harvest_from=policy: the {cfg.policy.backend} policy backend hands over no "
                             "hidden states; use drafter.harvest_from=rollout")
        # an EAGLE-3 drafter trains on its captured target layers and the final state, which the
        # policy's forward hands over in the rollout engine's layout when asked for them
        self.capture_layers = (self.drafter.drafter.capture_layers
                               if self.drafter and isinstance(self.drafter.drafter, CapturesLayers) else None)

    def _build_updates(self) -> None:
        """The synchronous update, and the one pipelined into the rollout's tail when configured."""
        cfg = self.cfg
        harvest = self.drafter.policy_sink if self.harvest_from == "policy" else None
        # the algorithm's advantages of whole groups, as both update paths compute them
        g = cfg.grpo
        advantages = partial(advantages_of, self.algorithm, group_size=g.group_size, max_new_tokens=g.max_new_tokens,
                             eos_id=self.task.tokenizer.eos_id)
        self.sync_update = SyncUpdate(cfg, self.policy, self.comm, advantages, self.replicas, self.share, harvest,
                                      self.capture_layers)
        self.pipeline = None
        if cfg.policy.pipelined_update:
            require(self.policy, PipelinedAccumulation, cfg.policy.backend, "policy.pipelined_update=true")
            self.pipeline = PipelinedStep(cfg, self.spec.mode, self.policy, self.comm, self.task,
                                          partial(harvest, own=None) if harvest is not None else None,
                                          self.capture_layers, self.replicas, advantages)

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
            close_all(bar, writer, self.saver, self.drafter)
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
        self.state.offload()  # rollout.training_state=offload: the policy's device memory is the engine's
        prompts = self.task.source.prompts(step, self.cfg.grpo.prompts_per_step, step_rng(self.cfg.seed, step))
        pipe = self.pipeline
        board = pipe.board(step) if pipe is not None and self.spec.tlt else None
        collector = pipe.collector(prompts, board) if pipe is not None else None
        rollout = rollout_phase(self.engine, self.task, self.cfg, self.replicas, step, prompts,
                                sd_policy=self.sd_policy, on_finish=collector, clock=self.coord.now,
                                drafter=self.drafter if self.harvest_from == "rollout" else None)
        early, t_early = {}, 0.0  # pieces of the update (and their seconds of work) before the meet
        if board is not None:  # the update's pieces while other ranks still decode, then idle
            self.state.reload()
            early, segments, t_early = pipe.claim(step, board, self.coord.now)
            rollout.segments.extend(segments)
        idle = self.idle_time(step, skip_drafter_round)
        t_meet, t_moved = time.perf_counter(), self.state.seconds()  # moves in the rollout's window are other_s
        timeline = self.coord.collect_timelines(step) if comm.rank == 0 else []
        self.coord.mark_busy()
        self.state.reload()  # nothing when the pipelined update has
        rewards = collector.rewards(rollout.ids) if collector is not None else self.score(prompts, rollout)
        if pipe is not None:
            update, t_update, t_work = pipe.finish(step, collector, rollout, early, board is None)
            t_logprob, t_work = 0.0, t_work + t_early
        else:
            batch = [(req.prompt, r.tokens) for req, r in zip(rollout.requests, rollout.out.results)]
            gen_logprobs = [r.logprobs for r in rollout.out.results]  # the logprob_gap metric's generation side
            update, t_logprob, t_update = self.sync_update(step, batch, rewards, gen_logprobs)
            t_work = t_logprob + t_update
        t0 = time.perf_counter()
        # rollout TP > 1: a model-parallel policy sends slices where the engine takes them (weight_stream.stream_tp)
        stream, policy_digest = sync_weights(self.policy, self.engine, self.drafter, self.sd_policy, idle,
                                             tp=self.engine_tp, keep=comm.rank == 0 and not self.saver.sharded,
                                             digest=self.cfg.debug.digest_at(step, self.cfg.steps - 1))
        self.saver.synced, weights, t_digest = stream.kept, stream.hexdigest(), stream.digest_s
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
        self.saver.after_step([r.state for r in ranks] if comm.rank == 0 else None)
        if comm.rank != 0:
            return {}
        if board is not None and step >= 2:  # every rank is past step - 2 (the gather above)
            pipe.cleanup(step - 2)
        times = {"step_s": time.perf_counter() - t_start, "rollout_s": t_meet - t_start - t_moved,
                 "logprob_s": t_logprob, "update_s": t_update, "weight_sync_s": t_sync, "weight_digest_s": t_digest,
                 **self.state.times()}
        return step_record(step, self.spec.mode, self.cfg.grpo.prompts_per_step * G, ranks, times, timeline,
                           self.t0, self.coord.now())

    # ---- the phases -----------------------------------------------------------
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
        """Every rank at the same point (``nemo_tlt.rl.state.run_saver``)."""
        self.saver.save(step, final, self.records, self.drafter)

    def resume(self) -> None:
        """Every rank reads the newest valid checkpoint of this run (if any) and restores from it."""
        records, self.start_step = self.saver.resume(self.engine, self.sd_policy, self.drafter, self.engine_tp)
        if records is not None:
            self.records = records


def run_rank(spec: RunSpec, comm: "Comm", stop: "StopFlag", on_step: Callable | None = None) -> dict[str, Any]:
    """Entry point of one rank (called by the launcher)."""
    return RLWorker(spec, comm, stop).run(on_step)

