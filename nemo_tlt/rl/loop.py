"""The GRPO loop with TLT, as run by every data-parallel rank (SPMD).

One RL step on every rank:
1. **rollout**: the step's prompts come from a generator seeded by (seed, step);
   rank r takes the prompts p with p % world == r, G samples each (whole groups,
   so advantages are local). Its own `TorchRolloutEngine` decodes them: TLT with
   adaptive SD (drafter + BEG-MAB), the baseline plainly.
2. **idle time**: a rank whose share is done marks itself IDLE; with TLT it trains
   the drafter on this step's harvested (tokens, hidden states) until the last
   rank finishes (preemption), then all ranks meet and average the drafter
   (weighted by samples trained); the engine loads it. Training runs on a thread
   of lowered OS priority (``drafter.nice``): where workers share CPU cores, the
   tail rollout of a busy worker must never wait for an idle worker's training.
3. **policy**: rewards -> group advantages -> log-probs recomputed by the policy
   (in the update's own forward: one optimizer step per RL step makes the sampling
   policy the one being updated; ``grpo.separate_logprob_pass`` recomputes them in
   a pass of their own first) -> clipped PG loss as a global token mean, gradients
   all-reduced, identical AdamW step on every rank -> the engine loads the new
   weights (weight sync).
4. rank 0 logs the step (JSONL, TensorBoard) and checkpoints (async).

Nothing the policy learns depends on SD: the prompts, the coupled-sampling seed
and the request ids are functions of (seed, step) only, so with ``coupled`` (or
``greedy``) acceptance TLT and baseline generate the same tokens and hence
compute the same rewards and weights, and a resumed run repeats the steps an
uninterrupted one would have taken.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.learned_policy import LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, SDPolicyConfig
from nemo_tlt.config import TLTConfig
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend
from nemo_tlt.rl.decode_segments import decode_segments
from nemo_tlt.rl.grpo import group_advantages
from nemo_tlt.rl.report import MetricsWriter
from nemo_tlt.rl.rewards import reward
from nemo_tlt.rl.tasks import Problem, make_problems
from nemo_tlt.rl.tokenizer import CharTokenizer
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.spot.checkpoint import CheckpointManager
from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from nemo_tlt.spot.losses import eagle_loss_fn
from nemo_tlt.spot.trainer import SpotTrainer, SpotTrainerConfig, train_while_idle

if TYPE_CHECKING:
    from nemo_tlt.dist import Comm, StopFlag

log = logging.getLogger(__name__)
MODES = ("tlt", "baseline")


@dataclass(frozen=True)
class RunSpec:
    """One run: the config, TLT or baseline, its folder, and the resolved model folders."""

    config: TLTConfig
    mode: str
    out_dir: str
    target_dir: str
    drafter_dir: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"RunSpec.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def tlt(self) -> bool:
        return self.mode == "tlt"

    @property
    def checkpoint_dir(self) -> Path:
        d = Path(self.config.checkpoint.dir)
        return d if d.is_absolute() else Path(self.out_dir) / d


def prepare_run_dir(spec: RunSpec) -> Path:
    """Create the run's folder and checkpoint folder; refuse one we cannot write."""
    ckpt = spec.checkpoint_dir
    try:
        Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        probe = ckpt / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"checkpoint.dir={spec.config.checkpoint.dir!r}: cannot write checkpoints to {ckpt} "
                         f"({err.strerror or err})") from None
    return ckpt


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of an RL step: a function of (seed, step) only."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


def step_problems(config: TLTConfig, step: int) -> list[Problem]:
    rng = np.random.default_rng([config.seed, step, 0x71])
    return make_problems(config.task.to_task_config(), config.grpo.prompts_per_step, rng)


def shard_prompts(num_prompts: int, rank: int, world: int) -> list[int]:
    """Whole prompt groups per rank (p % world == rank), so group advantages stay local."""
    return [p for p in range(num_prompts) if p % world == rank]


def digest(token_lists: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]


class RLWorker:
    """One rank's state across RL steps. See the module docstring."""

    def __init__(self, spec: RunSpec, comm: "Comm", stop: "StopFlag") -> None:
        cfg = spec.config
        self.spec, self.cfg, self.comm, self.stop = spec, cfg, comm, stop
        self.tok = CharTokenizer()
        policy_model = load_hf_folder(spec.target_dir)
        if policy_model.config.vocab_size != self.tok.vocab_size:
            raise ValueError(f"model.target_dir={spec.target_dir}: vocab_size {policy_model.config.vocab_size} "
                             f"does not match the task tokenizer's {self.tok.vocab_size}")
        policy_config = PolicyConfig(
            backend=cfg.policy.backend, tensor_parallel=cfg.policy.tensor_parallel,
            pipeline_parallel=cfg.policy.pipeline_parallel, micro_batch=cfg.grpo.micro_batch,
            separate_logprob_pass=cfg.grpo.separate_logprob_pass, clip_eps=cfg.grpo.clip_eps,
            kl_coef=cfg.grpo.kl_coef,
            optim=PolicyOptimConfig(lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay, grad_clip=cfg.grpo.grad_clip))
        self.policy = build_policy_backend(policy_config, policy_model.state_dict(), policy_model.config,
                                           temperature=cfg.grpo.temperature, seed=cfg.seed)
        self.mp_ranks = list(self.policy.train_ranks) if self.policy.sharded_state else None
        self.engine = TorchRolloutEngine(load_hf_folder(spec.target_dir))
        self.sd_policy = self.trainer = self.buffer = self.idle_thread = None
        if spec.tlt:
            self._build_tlt()
        self.coord = WorkerCoordinator(comm.store, comm.rank, comm.world, cfg.drafter.min_idle_workers,
                                       prefix=f"tlt/{spec.mode}", timeout_s=cfg.workers.timeout_s)
        self.ckpt = CheckpointManager(spec.checkpoint_dir, keep_last=cfg.checkpoint.keep_last) \
            if comm.rank == 0 else None
        self.records: list[dict[str, Any]] = []
        self.policy_states: list[dict] = [self.policy.state_dict()]
        self.rank_states: list[dict[str, Any]] = []  # rank 0: every rank's private state, gathered per step
        self.saved_step: int | None = None
        self.start_step = 0

    def _build_tlt(self) -> None:
        cfg, rank = self.cfg, self.comm.rank
        drafter = load_drafter(self.spec.drafter_dir, self.engine.target)
        self.engine.load_drafter(drafter)
        if cfg.rollout.sd_policy == "learned":
            self.sd_policy = LearnedSDPolicy(cfg.rollout.learned_config())
        else:
            bandit = BegMab(BanditConfig(cfg.rollout.shapes, cfg.rollout.bucket_edges, cfg.rollout.epsilon,
                                         cfg.rollout.window, cfg.rollout.min_pulls),
                            np.random.default_rng([cfg.seed, rank, 0xB4]))
            self.sd_policy = AdaptiveSDPolicy(
                SDPolicyConfig(cfg.rollout.sd_enabled, cfg.rollout.threshold_on, cfg.rollout.threshold_off,
                               reward=cfg.rollout.reward), bandit)
        hidden = self.engine.target.config.hidden_size
        self.buffer = HarvestBuffer(HarvestConfig(hidden, max_bytes=cfg.drafter.harvest_max_mb << 20))
        self.idle_thread = ThreadPoolExecutor(1, "tlt-idle", initializer=_init_idle_thread,
                                              initargs=(cfg.drafter.nice, torch.get_num_threads()))
        self.trainer = SpotTrainer(drafter, eagle_loss_fn(self.engine.target), SpotTrainerConfig(
            lr=cfg.drafter.lr, warmup_steps=cfg.drafter.warmup_steps, batch_size=cfg.drafter.micro_batch,
            max_steps_per_round=cfg.drafter.max_steps_per_idle, seed=cfg.seed), rank=rank)

    # ---- the run --------------------------------------------------------------
    def run(self, on_step: Callable | None = None) -> dict[str, Any]:
        t_run = time.perf_counter()
        self.t0 = self.coord.now()
        if self.cfg.resume:
            self._resume()
        status, step = "completed", self.start_step
        bar = _progress(self.cfg, self.spec.mode, self.start_step) if self.comm.rank == 0 else None
        writer = MetricsWriter(self.spec.out_dir, self.records) if self.comm.rank == 0 else None
        try:
            for step in range(self.start_step, self.cfg.steps):
                if self.comm.any(self.stop.requested):
                    status = "interrupted"
                    break
                record = self._step(step)
                if writer is not None:
                    self.records.append(record)
                    writer.write(record)
                    self._checkpoint(step, final=step == self.cfg.steps - 1)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")
                if on_step is not None:
                    on_step(step, record)
            else:
                step = self.cfg.steps
            if status == "interrupted" and self.comm.rank == 0 and self.records:
                self._checkpoint(self.records[-1]["step"], final=True)
                log.info("interrupted: checkpoint of step %d in %s; continue with resume=true",
                         self.records[-1]["step"], self.spec.checkpoint_dir)
        finally:
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
            if self.ckpt is not None:
                self.ckpt.close()
            if self.idle_thread is not None:
                self.idle_thread.shutdown(wait=True)
        return {"mode": self.spec.mode, "status": status, "records": self.records, "next_step": step,
                "wall_s": time.perf_counter() - t_run, "out_dir": self.spec.out_dir,
                "checkpoint_dir": str(self.spec.checkpoint_dir)}

    def _step(self, step: int) -> dict[str, Any]:
        cfg, comm = self.cfg, self.comm
        t_start = time.perf_counter()
        problems = step_problems(cfg, step)
        mine = shard_prompts(len(problems), comm.rank, comm.world)
        gen, idx, requests, segments = self._rollout(step, problems, mine)
        t_gen = time.perf_counter() - t_start
        idle = self._idle_time(step)
        t_meet = time.perf_counter()
        timeline = self.coord.collect_timelines(step) if comm.rank == 0 else []
        self.coord.mark_busy()
        G = cfg.grpo.group_size
        rewards = [reward(problems[p // G], self.tok.decode(r.tokens), cfg.grpo.format_bonus)
                   for p, r in zip(idx, gen.results)]
        batch = [(req.prompt, r.tokens) for req, r in zip(requests, gen.results)]
        local_tokens = sum(len(r.tokens) for r in gen.results)
        train_batch, train_rewards = self._model_parallel_union(batch, rewards)
        t0 = time.perf_counter()
        # old log-probs: the update forward's own unless a separate pass is asked for
        logp_old, logp_ref = self.policy.logprobs(train_batch, cfg.grpo.separate_logprob_pass)
        t_logprob = time.perf_counter() - t0
        t0 = time.perf_counter()
        # every response token of the step, counted once (each rank counts its own rollout)
        global_tokens = int(comm.sum_(torch.tensor([float(local_tokens)])).item())
        adv = group_advantages(torch.tensor(train_rewards, dtype=torch.float32), G)
        upd = self.policy.update(train_batch, adv, logp_old, logp_ref, global_tokens)
        t_update = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.engine.load_policy_weights(self._policy_weights())
        t_sync = time.perf_counter() - t0
        t_end = time.perf_counter()
        local = {"rank": comm.rank, "ids": idx, "tokens": [r.tokens for r in gen.results], "rewards": rewards,
                 "gen_s": t_gen, "gen": gen.stats.summary(), "accept": gen.stats.accept_lengths,
                 "segments": segments, **idle,
                 "upd": upd, "state": self._rank_state(), "weights": self._weights_digest()}
        per_rank = comm.gather(local)
        # With TP x PP > 1 the optimizer state is sharded: keep every rank's. Otherwise
        # it is identical on every rank and rank 0's is kept.
        self.policy_states = (comm.gather(self.policy.state_dict()) if self.mp_ranks is not None
                              else [self.policy.state_dict()])
        if comm.rank != 0:
            return {}
        self.rank_states = [r["state"] for r in per_rank]
        times = {"step_s": t_end - t_start, "rollout_s": t_meet - t_start, "logprob_s": t_logprob,
                 "update_s": t_update, "weight_sync_s": t_sync}
        return self._record(step, per_rank, times, timeline)

    def _model_parallel_union(self, batch: list, rewards: list[float]) -> tuple[list, list[float]]:
        """With TP x PP > 1 the ranks of one model-parallel group train one model replica
        together, so each trains on the union of the group's rollouts (in rank order;
        whole GRPO groups stay whole). Rollouts stay split over all ranks."""
        if self.mp_ranks is None:
            return batch, rewards
        shares = self.comm.gather((batch, rewards))
        union_batch = [seq for r in self.mp_ranks for seq in shares[r][0]]
        union_rewards = [x for r in self.mp_ranks for x in shares[r][1]]
        return union_batch, union_rewards

    def _rollout(self, step: int, problems: list[Problem], mine: list[int]):
        G = self.cfg.grpo.group_size
        idx = [p * G + g for p in mine for g in range(G)]
        requests = [Request(self.tok.encode(problems[i // G].prompt, add_bos=True), seq_id=i) for i in idx]
        sp = SamplingParams(self.cfg.grpo.acceptance, temperature=self.cfg.grpo.temperature,
                            max_new_tokens=self.cfg.grpo.max_new_tokens, seed=step_seed(self.cfg.seed, step))
        harvest = self.spec.tlt and self.cfg.drafter.train_on_idle
        t_gen = self.coord.now()
        out = self.engine.generate(requests, sp, return_hidden=harvest, policy=self.sd_policy)
        segments = decode_segments(out.stats.trace, out.stats.prefill_s, out.stats.wall_s, t_gen)
        if harvest:
            self.buffer.advance_step(step)
            for req, res in zip(requests, out.results):
                if len(req.prompt) + len(res.tokens) >= self.buffer.config.min_length:
                    self.buffer.add(torch.tensor(list(req.prompt) + res.tokens), res.hidden_states, step)
                res.hidden_states = None  # the buffer holds its own compact copy
        return out, idx, requests, segments

    def _idle_time(self, step: int) -> dict[str, Any]:
        """This rank's share is done: train the drafter until everyone is (TLT), meet."""
        if not (self.spec.tlt and self.cfg.drafter.train_on_idle):
            start = self.coord.timeline[-1].time
            self.coord.mark_idle()
            self.coord.meet(step)
            d = self.coord.durations(start)
            return {"idle_s": sum(v for k, v in d.items() if k.value != "busy"), "train_s": 0.0,
                    "drafter_samples": 0, "drafter_steps": 0, "drafter_loss": None, "stop_latency_s": None,
                    "drafter_sync_s": 0.0}
        # The idle-time protocol runs on a low-priority thread while this one waits.
        report = self.idle_thread.submit(train_while_idle, step, self.coord, self.trainer, self.buffer).result()
        t0 = time.perf_counter()
        self.engine.load_drafter(self.trainer.model)
        rnd = report.round
        if rnd.optimizer_steps:  # new drafter weights: the SD policy discounts what it learned of the old
            self.sd_policy.drafter_updated()
        return {"idle_s": report.idle_seconds, "train_s": report.training_seconds, "drafter_samples": rnd.samples,
                "drafter_steps": rnd.optimizer_steps, "drafter_loss": rnd.mean_loss if rnd.micro_steps else None,
                "stop_latency_s": report.stop_latency_s, "drafter_sync_s": time.perf_counter() - t0}

    # ---- metrics ----------------------------------------------------------------
    def _record(self, step: int, per_rank: list[dict], times: dict, timeline) -> dict[str, Any]:
        n = self.cfg.grpo.prompts_per_step * self.cfg.grpo.group_size
        rewards, tokens = [0.0] * n, [[] for _ in range(n)]
        for r in per_rank:
            for i, rew, toks in zip(r["ids"], r["rewards"], r["tokens"]):
                rewards[i], tokens[i] = rew, toks
        lengths = [len(t) for t in tokens]
        accept = [a for r in per_rank for a in r["accept"]]
        losses = [r["drafter_loss"] for r in per_rank if r["drafter_loss"] is not None]
        latencies = [r["stop_latency_s"] for r in per_rank if r["stop_latency_s"] is not None]
        upd = {k: sum(r["upd"][k] for r in per_rank) for k in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")}
        other = times["step_s"] - sum(times[k] for k in ("rollout_s", "logprob_s", "update_s", "weight_sync_s"))
        return {
            "step": step, "mode": self.spec.mode,
            "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
            "accuracy": float(np.mean([r == 1.0 for r in rewards])),
            "resp_len_mean": float(np.mean(lengths)), "resp_len_median": float(np.median(lengths)),
            "resp_len_max": int(max(lengths)), "tokens": int(sum(lengths)),
            **times, "other_s": other,
            "rollout_gen_s": [r["gen_s"] for r in per_rank],
            "drafter_train_s": float(sum(r["train_s"] for r in per_rank)),
            "idle_s": float(sum(r["idle_s"] for r in per_rank)),
            "drafter_sync_s": float(max(r["drafter_sync_s"] for r in per_rank)),
            "drafter_samples": int(sum(r["drafter_samples"] for r in per_rank)),
            "drafter_steps": int(sum(r["drafter_steps"] for r in per_rank)),
            "drafter_loss": float(np.mean(losses)) if losses else None,
            "preempt_latency_ms": 1000 * max(latencies) if latencies else None,
            "sd_steps": int(sum(r["gen"]["sd_steps"] for r in per_rank)),
            "plain_steps": int(sum(r["gen"]["plain_steps"] for r in per_rank)),
            "mean_accept_len": float(np.mean(accept)) if accept else 0.0,
            **upd, "grad_norm": per_rank[0]["upd"]["grad_norm"],
            # data parallelism must keep every rank's policy and drafter bit-identical
            "replicas_identical": all(r["weights"] == per_rank[0]["weights"] for r in per_rank),
            "rewards": rewards, "rollout_digest": digest(tokens),
            "timeline": [[e.rank, e.state.value, e.time - self.t0] for e in timeline],
            # per rank, where its rollout decoded plainly or with which tree (run-length)
            "decode_segments": [[r["rank"], round(a - self.t0, 4), round(b - self.t0, 4), choice]
                                for r in per_rank for a, b, choice in r["segments"]],
            "t_end": self.coord.now() - self.t0,
        }

    def _policy_weights(self) -> dict[str, torch.Tensor]:
        """The policy's canonical weights on this rank (a collective for megatron)."""
        return dict(self.policy.canonical_weights())

    def _weights_digest(self) -> str:
        # The engine holds the policy's weights since the last weight sync.
        h = hashlib.sha256()
        modules = [self.engine.target] + ([self.trainer.model] if self.trainer is not None else [])
        for module in modules:
            for t in module.state_dict().values():
                h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- checkpoints ------------------------------------------------------------------
    def _rank_state(self) -> dict[str, Any]:
        if not self.spec.tlt:
            return {}
        return {"sd_policy": self.sd_policy.state_dict(), "generator": self.trainer.generator.get_state().tolist()}

    def _checkpoint(self, step: int, final: bool) -> None:
        """Rank 0 only; the per-rank states were gathered at the end of the step."""
        if self.saved_step == step or (not final and (step + 1) % self.cfg.checkpoint.every):
            return
        tensors = {f"policy/{k}": v for k, v in self.engine.target.state_dict().items()}  # synced policy
        extra: dict[str, Any] = {"policy": self.policy_states}
        if self.spec.tlt:
            tensors.update({f"drafter/{k}": v for k, v in self.trainer.model.state_dict().items()})
            extra["drafter_trainer"] = self.trainer.state_dict()
        state = {"step": step, "mode": self.spec.mode, "world": self.comm.world, "ranks": self.rank_states,
                 "records": self.records}
        self.ckpt.save_async(step, tensors, extra, json.loads(json.dumps(state)))
        self.saved_step = step

    def _resume(self) -> None:
        """Every rank reads the newest valid checkpoint of this run (if any)."""
        if self.ckpt is not None:
            ck = self.ckpt.load() if self.ckpt.latest() is not None else None
        else:
            with CheckpointManager(self.spec.checkpoint_dir) as reader:
                ck = reader.load() if reader.latest() is not None else None
        if ck is None:
            log.info("resume=true but %s holds no checkpoint: starting at step 0", self.spec.checkpoint_dir)
            return
        if ck.json_state["world"] != self.comm.world:
            raise ValueError(f"resume: {ck.path} was written by {ck.json_state['world']} workers; "
                             f"workers.num_workers={self.comm.world} cannot continue it exactly")
        policy_sd = {k[len("policy/"):]: v for k, v in ck.tensors.items() if k.startswith("policy/")}
        self.policy.load_canonical(policy_sd)
        states = ck.extra_state["policy"]
        self.policy.load_state_dict(states[self.comm.rank] if len(states) > 1 else states[0])
        self.engine.load_policy_weights(policy_sd)
        if self.spec.tlt:
            self.trainer.model.load_state_dict(
                {k[len("drafter/"):]: v for k, v in ck.tensors.items() if k.startswith("drafter/")}, strict=True)
            self.trainer.load_state_dict(ck.extra_state["drafter_trainer"])
            mine = ck.json_state["ranks"][self.comm.rank]
            self.sd_policy.load_state_dict(mine["sd_policy"])
            self.trainer.generator.set_state(torch.tensor(mine["generator"], dtype=torch.uint8))
            self.engine.load_drafter(self.trainer.model)
            self.buffer = HarvestBuffer(self.buffer.config, start_step=ck.step + 1)
        self.records = list(ck.json_state["records"]) if self.comm.rank == 0 else []
        self.rank_states = list(ck.json_state["ranks"])
        self.saved_step = ck.step
        self.start_step = ck.step + 1


def _init_idle_thread(nice: int, num_threads: int) -> None:
    """Make the calling thread yield the CPU to rollout and policy work (Linux: per thread)
    and keep its math to the worker's thread budget: torch's intra-op thread count
    (OpenMP) is per thread, and a new thread would otherwise use every core, slowing
    the busy workers it shares them with (measured: 2 threads, 2x the speed of one, on
    a 2-core machine running two workers)."""
    torch.set_num_threads(num_threads)
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as err:  # a sandbox may forbid it; training still works, just unprioritised
            log.warning("drafter.nice=%d could not be applied: %s", nice, err)


def _progress(cfg: TLTConfig, mode: str, start: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=start, desc=f"RL steps ({mode})", unit="step", leave=True)


def run_rank(spec: RunSpec, comm: "Comm", stop: "StopFlag", on_step: Callable | None = None) -> dict[str, Any]:
    """Entry point of one rank (called by nemo_tlt.rl.workers.launch)."""
    worker = RLWorker(spec, comm, stop)
    return worker.run(on_step)
