"""`PlanConfig`: what ``nemo-tlt plan`` plans (model, cluster, layouts, batch, SD settings).

Contract: loaded like the training config (defaults <- YAML <- ``key=value``; OmegaConf
refuses unknown keys and wrong types, re-raised as ``ValueError`` naming the key); every
block validates itself. ``train_config`` optionally names the ``nemo-tlt train`` YAML the
plan is for (``check_train_config``): what the plan assumes must be what that run does, and a
disagreement is refused naming both keys and values. Compared: TP / PP, batch, response
length, SD threshold and arms, GPUs = workers, the weights dtype (``model.dtype``),
recompute and sequence parallelism (``policy.*``), the rollout engine's TP
(``rollout.tensor_parallel``, as ``nemo_tlt.rollout.factory.engine_tensor_parallel`` builds it),
the torch engine's KV budget (``rollout.kv_cache_gib`` or ``rollout.kv_cache_fraction``),
what the trainer keeps on the GPU during the rollout (the run's ``rollout.training_state``:
``resident`` is the plan's ``all``, ``offload`` its ``offload``; the plan's ``weights`` has no run
setting), and what the run's backends always do: the distributed optimizer (the megatron backend
always shards it, the torch backend never) and fp32 gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.config import load_config
from nemo_tlt.model.kv_budget import check_budget_keys
from nemo_tlt.structured import load_structured
from nemo_tlt.plan.cluster import ClusterSpec
from nemo_tlt.plan.memory import TRAINING_STATE, check_training_choices

# The memory and cost formulas are bf16's (2-byte weights, KV cache and activations; the GPU's bf16 peak).
PLAN_DTYPES = ("bfloat16",)
from nemo_tlt.speculative.tree_shape import TreeShape

# a run's rollout.training_state -> the plan's rollout.training_state (what stays on the GPU)
RUN_TRAINING_STATE = {"resident": "all", "offload": "offload"}


@dataclass(frozen=True)
class TrainingPlan:
    tensor_parallel: int = 8
    pipeline_parallel: int = 1
    micro_batch: int = 1
    sequence_parallel: bool = True
    recompute: str = "full"
    distributed_optimizer: bool = True
    grad_bytes: int = 4
    reserve_gib: float = 3.0
    layer_spec: str = "transformer_engine"  # what megatron builds: TE on a GPU where it imports, else local

    def __post_init__(self) -> None:
        check_int("training.tensor_parallel", self.tensor_parallel, 1)
        check_int("training.pipeline_parallel", self.pipeline_parallel, 1)
        check_int("training.micro_batch", self.micro_batch, 1)
        check_int("training.grad_bytes", self.grad_bytes, 2, 4)
        check_float("training.reserve_gib", self.reserve_gib, 0.0)
        check_training_choices(self.recompute, self.layer_spec, self.sequence_parallel)


@dataclass(frozen=True)
class RolloutPlan:
    tensor_parallel: int = 4
    prompt_len: int = 1024
    workspace_gib: float = 4.0
    training_state: str = "offload"  # what the trainer keeps on the GPU during rollout
    reserve_gib: float = 3.0
    kv_cache_gib: Optional[float] = None  # the run's rollout.kv_cache_gib: KV budget per GPU (null: unbounded)
    kv_cache_fraction: Optional[float] = None  # or the run's rollout.kv_cache_fraction: of the free memory

    def __post_init__(self) -> None:
        check_int("rollout.tensor_parallel", self.tensor_parallel, 1)
        check_budget_keys(self.kv_cache_gib, self.kv_cache_fraction)
        check_int("rollout.prompt_len", self.prompt_len, 1)
        check_float("rollout.workspace_gib", self.workspace_gib, 0.0)
        check_float("rollout.reserve_gib", self.reserve_gib, 0.0)
        if self.training_state not in TRAINING_STATE:
            raise ValueError(f"rollout.training_state must be one of {list(TRAINING_STATE)}, "
                             f"got {self.training_state!r}")


@dataclass(frozen=True)
class BatchPlan:
    prompts: int = 128
    group_size: int = 8
    max_response_len: int = 16384

    def __post_init__(self) -> None:
        check_int("batch.prompts", self.prompts, 1)
        check_int("batch.group_size", self.group_size, 1)
        check_int("batch.max_response_len", self.max_response_len, 1)


@dataclass(frozen=True)
class SDPlan:
    """Adaptive SD and drafter training. ``accepted[i]`` is the mean accepted length
    (tokens per target forward) of ``arms[i]`` with a drafter trained on the current policy:
    an input, to be taken from a measurement (``nemo-tlt bench rollout``), not a fit."""

    enabled: bool = True
    drafter_training: bool = True
    threshold: int = 32
    arms: List[str] = field(default_factory=lambda: ["4_1_4", "6_2_12", "8_4_32"])
    accepted: List[float] = field(default_factory=lambda: [3.0, 3.6, 4.2])
    epsilon: float = 0.1
    drift: float = 0.3
    recover_gpu_s: float = 600.0
    harvest_mb: int = 256
    # model the policy update pipelined into the rollout's tail (the RL loop's policy.pipelined_update,
    # torch policy backend only)
    pipelined_update: bool = False
    # of the idle replicas' capacity, what the pipelined update may take (the rest trains the
    # drafter); None: the simulator picks the share of the shortest step
    pipelined_share: Optional[float] = None

    def __post_init__(self) -> None:
        check_int("sd.threshold", self.threshold, 0)
        if self.pipelined_share is not None:
            check_float("sd.pipelined_share", self.pipelined_share, 0.0, 1.0)
        check_float("sd.epsilon", self.epsilon, 0.0, 1.0)
        check_float("sd.drift", self.drift, 0.0, 1.0)
        check_float("sd.recover_gpu_s", self.recover_gpu_s, 0.0, lo_open=True)
        check_int("sd.harvest_mb", self.harvest_mb, 0)
        if len(self.arms) != len(self.accepted) or not self.arms:
            raise ValueError(f"sd.arms ({len(self.arms)}) and sd.accepted ({len(self.accepted)}) must be "
                             "non-empty lists of the same length")
        object.__setattr__(self, "arms", tuple(self.arms))
        object.__setattr__(self, "accepted", tuple(float(a) for a in self.accepted))
        for i, (shape, acc) in enumerate(zip(self.shapes, self.accepted)):
            if not 1.0 <= acc <= shape.depth + 1:
                raise ValueError(f"sd.accepted[{i}]={acc} must be in [1, depth + 1 = {shape.depth + 1}] for {shape}")

    @property
    def shapes(self) -> tuple[TreeShape, ...]:
        return tuple(TreeShape.parse(s, field=f"sd.arms[{i}]") for i, s in enumerate(self.arms))


@dataclass(frozen=True)
class LengthPlan:
    median: float = 2000.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        check_float("lengths.median", self.median, 1.0)
        check_float("lengths.sigma", self.sigma, 0.0)


@dataclass(frozen=True)
class MeasuredPlan:
    """Where measured inputs come from (``nemo_tlt.plan.measured``): a `nemo-tlt train` run
    folder and / or a `nemo-tlt bench rollout` JSON; ``length_scaling`` ``median`` keeps the
    measured lengths' shape and sets their median to ``lengths.median``, ``none`` takes them as is."""

    run_dir: Optional[str] = None
    bench_json: Optional[str] = None
    length_scaling: str = "median"

    def __post_init__(self) -> None:
        if self.length_scaling not in ("median", "none"):
            raise ValueError(f"measured.length_scaling must be 'median' or 'none', got {self.length_scaling!r}")

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(p for p in (self.run_dir, self.bench_json) if p)


@dataclass(frozen=True)
class PlanConfig:
    model_config: str = "conf/models/qwen2.5-32b"  # folder holding the HF config.json
    train_config: Optional[str] = None             # the `nemo-tlt train` YAML this plan is for
    dtype: str = "bfloat16"                        # weights of engine, drafter and policy (the run's model.dtype)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    training: TrainingPlan = field(default_factory=TrainingPlan)
    rollout: RolloutPlan = field(default_factory=RolloutPlan)
    batch: BatchPlan = field(default_factory=BatchPlan)
    sd: SDPlan = field(default_factory=SDPlan)
    lengths: LengthPlan = field(default_factory=LengthPlan)
    measured: MeasuredPlan = field(default_factory=MeasuredPlan)
    steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 1)
        check_int("seed", self.seed, 0)
        if self.dtype not in PLAN_DTYPES:
            raise ValueError(f"dtype must be one of {list(PLAN_DTYPES)} (memory and costs are computed for bf16 "
                             f"weights, KV cache and activations), got {self.dtype!r}")
        world, mp = self.cluster.world, self.training.tensor_parallel * self.training.pipeline_parallel
        if world % mp:
            raise ValueError(f"training.tensor_parallel x pipeline_parallel = {mp} must divide the cluster's "
                             f"{world} GPUs (cluster.nodes x cluster.gpus_per_node)")
        if world % self.rollout.tensor_parallel:
            raise ValueError(f"rollout.tensor_parallel={self.rollout.tensor_parallel} must divide the cluster's "
                             f"{world} GPUs")
        if (self.batch.prompts * self.batch.group_size) % self.replicas:
            raise ValueError(f"batch.prompts x batch.group_size = {self.batch.prompts * self.batch.group_size} "
                             f"must split evenly over the {self.replicas} rollout replicas")

    @property
    def dp(self) -> int:
        return self.cluster.world // (self.training.tensor_parallel * self.training.pipeline_parallel)

    @property
    def replicas(self) -> int:
        return self.cluster.world // self.rollout.tensor_parallel


def load_plan_config(path: str | Path | None, overrides: Sequence[str] = ()) -> PlanConfig:
    """defaults <- plan YAML <- ``key=value`` overrides (nemo_tlt.config.load_structured); a
    plan that names a training config is checked against it."""
    config = load_structured(PlanConfig, path, overrides)
    if config.train_config is not None:
        check_train_config(config)
    return config


def check_train_config(plan: PlanConfig) -> None:
    """Refuse a plan that disagrees with the training config it names: each planned value
    against the run's key, or against what the run's backend always does (named after the key
    that picks that backend)."""
    from nemo_tlt.megatron.ddp_optimizer import DISTRIBUTED_OPTIMIZER, GRAD_BYTES
    from nemo_tlt.rollout.factory import engine_tensor_parallel

    train = load_config(plan.train_config)
    policy = train.policy
    megatron = policy.backend == "megatron"
    # (plan key, planned value, run key, its value, the run's value of the planned quantity, why)
    rows = [
        ("training.tensor_parallel", plan.training.tensor_parallel, "policy.tensor_parallel", policy.tensor_parallel),
        ("training.pipeline_parallel", plan.training.pipeline_parallel, "policy.pipeline_parallel",
         policy.pipeline_parallel),
        ("training.sequence_parallel", plan.training.sequence_parallel, "policy.sequence_parallel",
         policy.sequence_parallel),
        ("training.recompute", plan.training.recompute, "policy.recompute", policy.recompute),
        ("dtype", plan.dtype, "model.dtype", train.model.dtype),
        ("batch.prompts", plan.batch.prompts, "grpo.prompts_per_step", train.grpo.prompts_per_step),
        ("batch.group_size", plan.batch.group_size, "grpo.group_size", train.grpo.group_size),
        ("batch.max_response_len", plan.batch.max_response_len, "grpo.max_new_tokens", train.grpo.max_new_tokens),
        ("sd.enabled", plan.sd.enabled, "rollout.sd_enabled", train.rollout.sd_enabled),
        ("sd.threshold", plan.sd.threshold, "rollout.threshold.threshold_on", train.rollout.threshold.threshold_on),
        ("sd.arms", tuple(plan.sd.arms), "rollout.bandit.arms", tuple(a.name for a in train.rollout.bandit.arms)),
        ("sd.drafter_training", plan.sd.drafter_training, "drafter.train_on_idle", train.drafter.train_on_idle),
        ("cluster GPUs", plan.cluster.world, "workers.num_workers", train.workers.num_workers),
        ("rollout.tensor_parallel", plan.rollout.tensor_parallel, "rollout.tensor_parallel",
         engine_tensor_parallel(train.rollout)),
        ("rollout.kv_cache_gib", plan.rollout.kv_cache_gib, "rollout.kv_cache_gib", train.rollout.kv_cache_gib),
        ("rollout.kv_cache_fraction", plan.rollout.kv_cache_fraction, "rollout.kv_cache_fraction",
         train.rollout.kv_cache_fraction),
    ]
    derived = [
        ("training.distributed_optimizer", plan.training.distributed_optimizer, "policy.backend", policy.backend,
         megatron and DISTRIBUTED_OPTIMIZER,
         "megatron-core's DistributedOptimizer shards the optimizer over DP" if megatron
         else "every replica of the torch backend holds the whole optimizer state"),
        ("training.grad_bytes", plan.training.grad_bytes, "policy.backend", policy.backend, GRAD_BYTES,
         "fp32 gradients"),
        ("rollout.training_state", plan.rollout.training_state, "rollout.training_state",
         train.rollout.training_state, RUN_TRAINING_STATE[train.rollout.training_state],
         "what the trainer keeps on the GPU while the engine decodes"),
    ]
    for mine, a, theirs, b in rows:
        if a != b:
            raise ValueError(f"plan {mine}={a!r} disagrees with {plan.train_config}: {theirs}={b!r}")
    for mine, a, theirs, b, runs, why in derived:
        if a != runs:
            raise ValueError(f"plan {mine}={a!r} disagrees with {plan.train_config}: {theirs}={b!r} runs with "
                             f"{mine.split('.')[-1]}={runs!r} ({why})")
