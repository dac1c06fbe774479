"""The typed top-level ``tlt`` configuration of a training run.

Contract
--------
* Every block is a frozen dataclass usable as an OmegaConf structured config, so
  ``load_config(yaml, overrides)`` merges ``defaults <- YAML <- key=value`` and
  OmegaConf refuses unknown keys and values of the wrong type; both are re-raised
  here as a ``ValueError`` that names the full key (``grpo.group_size``).
* Each block validates its own values in ``__post_init__`` (``ValueError`` naming
  ``block.field``); ``TLTConfig.__post_init__`` checks what crosses blocks (the
  context window, the bandit's arms). A config that constructs is runnable.
* fastrl's ``depth_topk_numverify`` arm strings are parsed into ``TreeShape`` at this
  boundary only (``RolloutBlock.shapes``); nothing downstream sees strings.
* Environment checks (is the checkpoint folder writable?) are not config validation;
  they happen when a run starts (``nemo_tlt.rl.loop.prepare_run_dir``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_tlt.adaptive.learned_policy import LearnedSDConfig
from nemo_tlt.adaptive.sd_policy import REWARDS
from nemo_tlt.checks import check_float, check_int
from nemo_tlt.demo.tasks import TASK_NAMES, TaskConfig
from nemo_tlt.speculative.sampling import MODES
from nemo_tlt.speculative.tree_shape import TreeShape

START_METHODS = ("spawn", "fork", "forkserver")


@dataclass(frozen=True)
class TaskBlock:
    """The verifiable task prompts are drawn from (see nemo_tlt.rl.tasks.TaskConfig).
    The defaults are the demo assets' task, the one the warm start was trained on."""

    name: str = "arith"
    min_steps: int = 1
    max_steps: int = 0  # 0: the largest that fits max_solution_chars
    tail_exponent: float = 1.3
    max_solution_chars: int = 400
    max_value: int = 99

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ValueError(f"task.name must be one of {list(TASK_NAMES)}, got {self.name!r}")
        try:
            self.to_task_config()
        except ValueError as err:
            raise ValueError(f"task: {err}") from None

    def to_task_config(self) -> TaskConfig:
        return TaskConfig(**asdict(self))


@dataclass(frozen=True)
class ModelBlock:
    """Where the warm-started policy and the initial drafter come from. Unset
    (null) folders mean the demo assets: prepared once (SFT warm start + EAGLE
    drafter) and cached under ``cache_dir`` (default ``$NEMO_TLT_CACHE`` or
    ``~/.cache/nemo_tlt``), shared with ``nemo-tlt bench``."""

    target_dir: Optional[str] = None
    drafter_dir: Optional[str] = None
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.target_dir is None) != (self.drafter_dir is None):
            raise ValueError("model.target_dir and model.drafter_dir must be given together "
                             "(or both left null for the cached demo assets)")


@dataclass(frozen=True)
class GRPOBlock:
    """GRPO: ``prompts_per_step`` prompts x ``group_size`` samples per RL step."""

    group_size: int = 4
    prompts_per_step: int = 8
    lr: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0 keeps a frozen reference policy and adds a k3 KL penalty
    max_new_tokens: int = 400
    temperature: float = 1.0
    acceptance: str = "coupled"  # greedy | rejection | coupled (see speculative.sampling)
    format_bonus: float = 0.0  # reward of a well-formed but wrong answer
    micro_batch: int = 4  # sequences per log-prob / update forward (length-sorted)
    # The update makes one optimizer step per RL step, so the policy that sampled is the
    # one being updated and the old log-probs are the update forward's own (detached;
    # ratio 1, as TRL's GRPO does with one iteration). true: recompute them in a
    # separate no-grad pass first (for a policy whose train and eval forwards differ).
    separate_logprob_pass: bool = False

    def __post_init__(self) -> None:
        check_int("grpo.group_size", self.group_size, 1)
        check_int("grpo.prompts_per_step", self.prompts_per_step, 1)
        check_int("grpo.max_new_tokens", self.max_new_tokens, 1)
        check_int("grpo.micro_batch", self.micro_batch, 1)
        check_float("grpo.lr", self.lr, 0.0, lo_open=True)
        check_float("grpo.weight_decay", self.weight_decay, 0.0)
        check_float("grpo.grad_clip", self.grad_clip, 0.0)
        check_float("grpo.clip_eps", self.clip_eps, 0.0, lo_open=True)
        if self.clip_eps >= 1.0:
            raise ValueError(f"grpo.clip_eps must be in (0, 1), got {self.clip_eps!r}")
        check_float("grpo.kl_coef", self.kl_coef, 0.0)
        if not isinstance(self.separate_logprob_pass, bool):
            raise ValueError(f"grpo.separate_logprob_pass must be a bool, got {self.separate_logprob_pass!r}")
        check_float("grpo.temperature", self.temperature, 0.0, lo_open=True)
        check_float("grpo.format_bonus", self.format_bonus, 0.0)
        if self.format_bonus >= 1.0:
            raise ValueError(f"grpo.format_bonus must be in [0, 1), got {self.format_bonus!r}")
        if self.acceptance not in MODES:
            raise ValueError(f"grpo.acceptance must be one of {list(MODES)}, got {self.acceptance!r}")


SD_POLICIES = ("threshold", "learned")


@dataclass(frozen=True)
class RolloutBlock:
    """Adaptive SD, per worker. ``sd_policy: threshold``: SD on when the running batch is
    <= threshold_on, off again above threshold_off; BEG-MAB picks one of ``arms`` per
    batch-size bucket. ``sd_policy: learned``: per bucket, plain decoding or one of
    ``arms`` from the measured cost of the steps that ran, falling back to plain when
    the drafter's acceptance collapses (nemo_tlt.adaptive.learned_policy); the
    thresholds, epsilon and reward are not used, ``max_sd_running`` is an optional bound."""

    sd_enabled: bool = True
    sd_policy: str = "threshold"
    threshold_on: int = 8
    threshold_off: int = 12
    arms: List[str] = field(default_factory=lambda: ["4_2_8", "6_2_12", "3_1_3"])
    bucket_edges: List[int] = field(default_factory=lambda: [2, 4])
    epsilon: float = 0.1
    window: int = 32
    min_pulls: int = 1          # pulls of every arm per bucket before the bandit exploits
    reward: str = "scaled"      # bandit reward: "scaled", "per_row" or "throughput" (see SDPolicyConfig)
    max_sd_running: Optional[int] = None  # learned: never speculate above this many running rows (null: no bound)
    collapse_accept: float = 1.3  # learned: accepted tokens per row per SD step below which SD counts as lost

    def __post_init__(self) -> None:
        if self.sd_policy not in SD_POLICIES:
            raise ValueError(f"rollout.sd_policy must be one of {', '.join(SD_POLICIES)}, got {self.sd_policy!r}")
        if self.max_sd_running is not None:
            check_int("rollout.max_sd_running", self.max_sd_running, 1)
        check_float("rollout.collapse_accept", self.collapse_accept, 1.0)
        if self.reward not in REWARDS:
            raise ValueError(f"rollout.reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        check_int("rollout.threshold_on", self.threshold_on, 1)
        check_int("rollout.threshold_off", self.threshold_off, 1)
        if self.threshold_off < self.threshold_on:
            raise ValueError(f"rollout.threshold_off={self.threshold_off} must be >= rollout.threshold_on="
                             f"{self.threshold_on} (SD turns on at <= threshold_on, off at > threshold_off)")
        check_float("rollout.epsilon", self.epsilon, 0.0, 1.0)
        check_int("rollout.window", self.window, 1)
        check_int("rollout.min_pulls", self.min_pulls, 1)
        if self.min_pulls > self.window:
            raise ValueError(f"rollout.min_pulls={self.min_pulls} must be <= rollout.window={self.window}")
        object.__setattr__(self, "arms", tuple(self.arms))
        object.__setattr__(self, "bucket_edges", tuple(self.bucket_edges))
        if not self.arms:
            raise ValueError("rollout.arms must list at least one 'depth_topk_numverify' tree shape")
        for i, arm in enumerate(self.arms):
            if str(arm).isdigit():
                # YAML 1.1 reads 4_2_8 as the integer 428; the shape is gone before we see it.
                raise ValueError(f"rollout.arms[{i}]={arm!r}: YAML read an unquoted arm such as 4_2_8 as a "
                                 "number; quote each arm, e.g. arms: ['4_2_8', '6_2_12']")
        self.shapes  # parse now: a malformed arm fails at load time, naming its index
        for i, edge in enumerate(self.bucket_edges):
            check_int(f"rollout.bucket_edges[{i}]", edge, 2)
            if i and edge <= self.bucket_edges[i - 1]:
                raise ValueError(f"rollout.bucket_edges must be strictly increasing, got {list(self.bucket_edges)}")

    def learned_config(self) -> LearnedSDConfig:
        """The learned SD policy's config from this block (``sd_policy: learned``)."""
        return LearnedSDConfig(self.shapes, self.bucket_edges, window=self.window, min_pulls=self.min_pulls,
                               collapse_accept=self.collapse_accept, max_sd_running=self.max_sd_running,
                               enabled=self.sd_enabled)

    @property
    def shapes(self) -> tuple[TreeShape, ...]:
        return tuple(TreeShape.parse(s, field=f"rollout.arms[{i}]") for i, s in enumerate(self.arms))


@dataclass(frozen=True)
class DrafterBlock:
    """Drafter training on idle workers (TLT runs only)."""

    train_on_idle: bool = True
    min_idle_workers: int = 1
    lr: float = 3e-4
    warmup_steps: int = 5
    micro_batch: int = 8  # harvested sequences per drafter micro-step
    max_steps_per_idle: Optional[int] = None  # cap per idle window (null: until preempted)
    harvest_max_mb: int = 256
    # OS niceness of the thread that trains on idle time (0: same as rollout). Where
    # workers share CPU cores, a busy worker's tail rollout must win every contention.
    nice: int = 19

    def __post_init__(self) -> None:
        check_int("drafter.min_idle_workers", self.min_idle_workers, 1)
        check_int("drafter.nice", self.nice, 0, 19)
        check_float("drafter.lr", self.lr, 0.0, lo_open=True)
        check_int("drafter.warmup_steps", self.warmup_steps, 0)
        check_int("drafter.micro_batch", self.micro_batch, 1)
        if self.max_steps_per_idle is not None:
            check_int("drafter.max_steps_per_idle", self.max_steps_per_idle, 1)
        check_int("drafter.harvest_max_mb", self.harvest_max_mb, 1)


@dataclass(frozen=True)
class WorkersBlock:
    """Data-parallel rollout workers (processes; gloo + TCPStore). One worker runs in
    the calling process; ``threads_per_worker`` applies to it as to every worker."""

    num_workers: int = 2
    threads_per_worker: int = 1  # torch intra-op threads of each worker
    start_method: str = "spawn"
    timeout_s: float = 900.0  # longest a worker waits for the others before failing loudly

    def __post_init__(self) -> None:
        check_int("workers.num_workers", self.num_workers, 1)
        check_int("workers.threads_per_worker", self.threads_per_worker, 1)
        if self.start_method not in START_METHODS:
            raise ValueError(f"workers.start_method must be one of {list(START_METHODS)}, got {self.start_method!r}")
        check_float("workers.timeout_s", self.timeout_s, 0.0, lo_open=True)


@dataclass(frozen=True)
class CheckpointBlock:
    dir: str = "checkpoints"  # relative paths are under the run's folder
    keep_last: int = 2
    every: int = 1  # RL steps between checkpoints (the last step and an interrupt always save)

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("checkpoint.dir must not be empty")
        check_int("checkpoint.keep_last", self.keep_last, 1)
        check_int("checkpoint.every", self.every, 1)


@dataclass(frozen=True)
class PolicyBlock:
    """Which policy backend trains: the plain-PyTorch ``DecoderLM`` (``torch``) or a
    megatron-core ``GPTModel`` (``megatron``, gloo on CPU / NCCL on GPU). In the RL loop
    every rollout worker is one Megatron rank: ``num_workers`` = TP x PP x data-parallel
    replicas; rollouts are split over all workers and each model-parallel group trains
    on the union of its workers' rollouts."""

    backend: str = "torch"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "megatron"):
            raise ValueError(f"policy.backend must be 'torch' or 'megatron', got {self.backend!r}")
        check_int("policy.tensor_parallel", self.tensor_parallel, 1)
        check_int("policy.pipeline_parallel", self.pipeline_parallel, 1)
        if self.backend == "torch" and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            raise ValueError(f"policy.tensor_parallel / pipeline_parallel > 1 need policy.backend=megatron, "
                             f"got backend {self.backend!r}")


@dataclass(frozen=True)
class TLTConfig:
    run_dir: str = "runs/demo"
    seed: int = 0
    steps: int = 4
    resume: bool = False
    progress: bool = True
    task: TaskBlock = field(default_factory=TaskBlock)
    model: ModelBlock = field(default_factory=ModelBlock)
    grpo: GRPOBlock = field(default_factory=GRPOBlock)
    rollout: RolloutBlock = field(default_factory=RolloutBlock)
    drafter: DrafterBlock = field(default_factory=DrafterBlock)
    workers: WorkersBlock = field(default_factory=WorkersBlock)
    checkpoint: CheckpointBlock = field(default_factory=CheckpointBlock)
    policy: PolicyBlock = field(default_factory=PolicyBlock)

    def __post_init__(self) -> None:
        if self.policy.backend == "megatron":
            if self.workers.num_workers < 2:
                raise ValueError("policy.backend=megatron needs workers.num_workers >= 2 (a gloo process group)")
            mp = self.policy.tensor_parallel * self.policy.pipeline_parallel
            if self.workers.num_workers % mp:
                raise ValueError(f"workers.num_workers={self.workers.num_workers} must be a multiple of "
                                 f"policy.tensor_parallel x policy.pipeline_parallel = {mp}")
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        check_int("seed", self.seed, 0, 2**31 - 1)
        check_int("steps", self.steps, 1)
        if self.drafter.min_idle_workers > self.workers.num_workers:
            raise ValueError(f"drafter.min_idle_workers={self.drafter.min_idle_workers} exceeds "
                             f"workers.num_workers={self.workers.num_workers}")
        if self.grpo.prompts_per_step < self.workers.num_workers:
            raise ValueError(f"grpo.prompts_per_step={self.grpo.prompts_per_step} leaves a worker without prompts "
                             f"(workers.num_workers={self.workers.num_workers}); each worker takes whole groups")

    @property
    def tlt_enabled(self) -> bool:
        """TLT proper: adaptive SD in the rollout (drafter training may still be off)."""
        return self.rollout.sd_enabled

    def baseline(self) -> "TLTConfig":
        """The same run without TLT: plain decoding, no drafter training."""
        return replace(self, rollout=replace(self.rollout, sd_enabled=False),
                       drafter=replace(self.drafter, train_on_idle=False))

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))


def _reraise(err: OmegaConfBaseException, source: str) -> ValueError:
    key = getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"{source}: config key '{key}': {first}")


def load_structured(schema: type, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Any:
    """defaults of the dataclass ``schema`` <- YAML file <- ``key=value`` overrides, typed
    and validated; every error is a ValueError naming the file (or "overrides") and the key."""
    merged: DictConfig = OmegaConf.structured(schema)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        loaded = OmegaConf.load(p)
        if not isinstance(loaded, DictConfig):
            raise ValueError(f"{p}: the config must be a YAML mapping, got a {type(loaded).__name__}")
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as err:
            raise _reraise(err, str(p)) from None
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value")
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as err:
        raise _reraise(err, "overrides") from None
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _reraise(err, "config") from None
    assert isinstance(config, schema)
    return config


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TLTConfig:
    """defaults <- YAML file <- ``key=value`` overrides, typed and validated."""
    return load_structured(TLTConfig, path, overrides)

