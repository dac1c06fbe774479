"""The typed top-level ``tlt`` configuration of a training run.

Contract
--------
* One tree: each component's own config class nests directly (``policy`` is
  :class:`~nemo_tlt.policy.config.PolicyConfig`, ``rollout`` is
  :class:`~nemo_tlt.rollout.config.RolloutConfig`, ``drafter`` is
  :class:`~nemo_tlt.spot.config.IdleDrafterConfig`); the blocks only the run itself
  reads (task, model, grpo, workers, checkpoint) are defined here. Nothing is
  copied field by field downstream: the loop hands each block to its component.
* ``load_config(yaml, overrides)`` merges ``defaults <- YAML <- overrides``
  (``key=value``, and as Hydra / NeMo users type them ``+key=value``, ``++key=value``,
  ``~key``: see :func:`nemo_tlt.structured.load_structured`); unknown keys and values of
  the wrong type are refused by OmegaConf, and every
  error is a ``ValueError`` naming the key as the user writes it
  (``rollout.bandit.epsilon``): a component names its fields ``ClassName.field``
  and the loader rewrites that to the key path where the class is nested.
* Each class validates its own values at construction; ``TLTConfig.__post_init__``
  checks what crosses blocks. A config that constructs is runnable.
* Environment checks (is the checkpoint folder writable? does the reward import?)
  are not config validation; they happen when a run starts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_tlt.algorithms.registry import ALGORITHMS, check_algorithm
from nemo_tlt.checks import check_float, check_int
from nemo_tlt.structured import load_structured, merge_structured, parse_override
from nemo_tlt.device import DEVICES, DTYPES
from nemo_tlt.dist.launchers import BUILT_IN_MODES, LAUNCHERS
from nemo_tlt.imports import check_import_path, is_import_path
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.rollout.config import ENGINES, RolloutConfig
from nemo_tlt.speculative.sampling import MODES
from nemo_tlt.speculative.tree_shape import TreeShape
from nemo_tlt.spot.config import IdleDrafterConfig

START_METHODS = ("spawn", "fork", "forkserver")
TASK_JSONL, TASK_DATASETS, TASK_HF = "jsonl", "datasets", "hf"  # built-in sources and tokenizer (nemo_tlt.rl.data.task)
# the options each built-in source takes (order / shuffle_seed: nemo_tlt.rl.data.task.draw_rows)
TASK_SOURCE_OPTIONS = {
    TASK_JSONL: ("path", "prompt_key", "answer_key", "order", "shuffle_seed"),
    TASK_DATASETS: ("path", "format", "prompt_key", "answer_key", "order", "shuffle_seed"),
}
_STR_OPTIONS = ("path", "format", "prompt_key", "answer_key", "order")
TASK_ORDERS = ("epochs", "random")  # epochs without replacement | a fresh draw each step


def _check_options(key: str, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{key} must be a mapping of keyword names to values, got {value!r}")


def _check_builtin_options(source: str, options: Mapping[str, Any], key: str = "task.options") -> None:
    known = TASK_SOURCE_OPTIONS[source]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{key} has keys {unknown} that task.source={source!r} does not take; known: {list(known)}")
    if "path" not in options:
        raise ValueError(f"{key}.path is required with task.source={source!r} (the file of prompts)")
    for name in _STR_OPTIONS:
        if name in options and (not isinstance(options[name], str) or not options[name]):
            raise ValueError(f"{key}.{name} must be a non-empty string, got {options[name]!r}")
    if "order" in options and options["order"] not in TASK_ORDERS:
        raise ValueError(f"{key}.order must be one of {list(TASK_ORDERS)}, got {options['order']!r}")
    if "shuffle_seed" in options:
        check_int(f"{key}.shuffle_seed", options["shuffle_seed"], 0)


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts, tokenizer and reward come from (usable as an OmegaConf structured config).

    ``source``: ``"jsonl"`` or the import path of a factory, ``factory(**options)
    -> TaskSource``. ``options``: its keyword arguments (for ``jsonl``: path,
    prompt_key, answer_key); empty means the factory's own defaults (for the demo,
    the task its shipped models were trained on). ``reward``: import path of a
    RewardFn, called with ``reward_options`` as keywords. ``tokenizer``: ``"hf"``
    (the tokenizer saved in ``model.target_dir``) or the import path of a
    zero-argument factory. ``source: datasets`` reads a local json / jsonl / parquet
    file with HF ``datasets`` (options: path, format, prompt_key, answer_key); both
    built-in sources take ``order`` (``epochs`` | ``random``) and ``shuffle_seed``.
    ``chat_template``: the ``hf`` tokenizer renders each prompt as a user turn through
    the model's chat template (after ``system_prompt`` as a system turn, if given).
    """

    source: str = "nemo_tlt.demo.tasks:ArithTaskSource"
    options: Dict[str, Any] = field(default_factory=dict)
    reward: str = "nemo_tlt.demo.rewards:arith_reward"
    reward_options: Dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "nemo_tlt.demo.tokenizer:CharTokenizer"
    chat_template: bool = False
    system_prompt: Optional[str] = None

    def __post_init__(self) -> None:
        if self.source not in TASK_SOURCE_OPTIONS:
            if not is_import_path(self.source):
                raise ValueError(f"task.source must be 'jsonl', 'datasets' or an import path "
                                 f"'package.module:factory', got {self.source!r}")
        _check_options("task.options", self.options)
        _check_options("task.reward_options", self.reward_options)
        if self.source in TASK_SOURCE_OPTIONS:
            _check_builtin_options(self.source, self.options)
        if self.chat_template and self.tokenizer != TASK_HF:
            raise ValueError(f"task.chat_template=true needs task.tokenizer='hf' (the model's own tokenizer and "
                             f"its template), got task.tokenizer={self.tokenizer!r}")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("task.system_prompt is a turn of the chat template: it needs task.chat_template=true")
        check_import_path(self.reward, "task.reward")
        if self.tokenizer != TASK_HF:
            if not is_import_path(self.tokenizer):
                raise ValueError(f"task.tokenizer must be 'hf' or an import path 'package.module:factory', "
                                 f"got {self.tokenizer!r}")
        # Plain dicts of our own: OmegaConf hands over its containers, callers their dicts.
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "reward_options", dict(self.reward_options))


@dataclass(frozen=True)
class ModelConfig:
    """Where the warm-started policy and the initial drafter come from. Unset (null)
    folders mean the demo assets: shipped with the package, or prepared once and
    cached under ``cache_dir`` (default ``$NEMO_TLT_CACHE`` or ``~/.cache/nemo_tlt``).

    ``dtype``: the weights dtype of the rollout engine, the drafter and the policy
    (``float32`` | ``bfloat16``); the policy keeps fp32 master weights, gradient
    reduction and optimizer state either way."""

    target_dir: Optional[str] = None
    drafter_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if (self.target_dir is None) != (self.drafter_dir is None):
            raise ValueError("ModelConfig.target_dir and ModelConfig.drafter_dir must be given together "
                             "(or both left null for the demo assets)")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO sampling: ``prompts_per_step`` prompts x ``group_size`` samples per RL step.
    The loss (clip, KL) and the optimizer are the policy's (``policy:``)."""

    group_size: int = 4
    prompts_per_step: int = 8
    max_new_tokens: int = 400
    temperature: float = 1.0  # of sampling, and so of the log-probs the policy computes
    acceptance: str = "coupled"  # greedy | rejection | coupled (see speculative.sampling)

    def __post_init__(self) -> None:
        check_int("GRPOConfig.group_size", self.group_size, 1)
        check_int("GRPOConfig.prompts_per_step", self.prompts_per_step, 1)
        check_int("GRPOConfig.max_new_tokens", self.max_new_tokens, 1)
        check_float("GRPOConfig.temperature", self.temperature, 0.0, lo_open=True)
        if self.acceptance not in MODES:
            raise ValueError(f"GRPOConfig.acceptance must be one of {list(MODES)}, got {self.acceptance!r}")


@dataclass(frozen=True)
class WorkersConfig:
    """Rollout workers (processes; gloo + TCPStore). One worker runs in the calling
    process; ``threads_per_worker`` applies to it as to every worker. With
    ``policy.backend=megatron`` every worker is one Megatron rank.

    ``launcher``: ``local`` starts the workers as local processes; ``slurm`` makes this
    process one worker, an ``srun`` task (``nemo_tlt.dist.slurm``; SLURM's task count
    must equal ``num_workers``); ``torchrun`` makes it one worker started by torchrun
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); ``auto``
    is ``torchrun`` when those variables are set, ``slurm`` inside an srun step of more
    than one task, and ``local`` otherwise.

    ``device``: ``cpu``, ``cuda`` (rank r binds ``cuda:LOCAL_RANK``; NCCL carries tensor
    collectives, gloo Python objects) or ``auto`` (``cuda`` when CUDA is available)."""

    num_workers: int = 2
    threads_per_worker: int = 1  # torch intra-op threads of each worker
    start_method: str = "spawn"
    timeout_s: float = 900.0  # longest a worker waits for the others before failing loudly
    # Under a SLURM time limit: no RL step starts that cannot end (with its checkpoint)
    # this many seconds before the limit; the run checkpoints and stops instead.
    time_limit_margin_s: float = 60.0
    launcher: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        check_int("WorkersConfig.num_workers", self.num_workers, 1)
        check_int("WorkersConfig.threads_per_worker", self.threads_per_worker, 1)
        if self.start_method not in START_METHODS:
            raise ValueError(f"WorkersConfig.start_method must be one of {list(START_METHODS)}, "
                             f"got {self.start_method!r}")
        check_float("WorkersConfig.timeout_s", self.timeout_s, 0.0, lo_open=True)
        check_float("WorkersConfig.time_limit_margin_s", self.time_limit_margin_s, 0.0)
        if self.launcher not in BUILT_IN_MODES and self.launcher not in LAUNCHERS and not is_import_path(self.launcher):
            raise ValueError(f"WorkersConfig.launcher must be one of {[*BUILT_IN_MODES, *LAUNCHERS]} or an import "
                             f"path 'package.module:LAUNCHER', got {self.launcher!r}")
        if self.device not in DEVICES:
            raise ValueError(f"WorkersConfig.device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and self.start_method == "fork" and self.num_workers > 1:
            raise ValueError("WorkersConfig.start_method=fork cannot start workers.device=cuda workers (a forked "
                             "process cannot initialise CUDA); use workers.start_method=spawn")


@dataclass(frozen=True)
class ValidationConfig:
    """Evaluation on held-out prompts every ``every`` RL steps (0: never); see
    ``nemo_tlt.rl.data.validation``. The validation source is ``task.source`` built with
    ``options`` merged over ``task.options`` (e.g. ``{path: data/val.parquet}``).
    ``num_prompts``: how many of its prompts, the same ones at every evaluation (null:
    every row; the source must have a length). ``greedy``: decode greedily (else with
    ``grpo.acceptance`` and ``grpo.temperature``); ``max_new_tokens`` null: the grpo's."""

    every: int = 0
    options: Dict[str, Any] = field(default_factory=dict)
    num_prompts: Optional[int] = None
    greedy: bool = True
    max_new_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        check_int("ValidationConfig.every", self.every, 0)
        _check_options("ValidationConfig.options", self.options)
        if self.num_prompts is not None:
            check_int("ValidationConfig.num_prompts", self.num_prompts, 1)
        if self.max_new_tokens is not None:
            check_int("ValidationConfig.max_new_tokens", self.max_new_tokens, 1)
        object.__setattr__(self, "options", dict(self.options))


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "checkpoints"  # relative paths are under the run's folder
    keep_last: int = 2
    every: int = 1  # RL steps between checkpoints (the last step and an interrupt always save)

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("CheckpointConfig.dir must not be empty")
        check_int("CheckpointConfig.keep_last", self.keep_last, 1)
        check_int("CheckpointConfig.every", self.every, 1)


WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (``pip install 'nemo-tlt[wandb]'``). ``name`` unset: the run
    folder; ``mode`` unset: W&B's own choice (``WANDB_MODE``, else online)."""

    enabled: bool = False
    project: str = "nemo-tlt"
    entity: Optional[str] = None
    name: Optional[str] = None
    mode: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.project:
            raise ValueError("WandbConfig.project must not be empty")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"WandbConfig.mode must be one of {list(WANDB_MODES)} (or null), got {self.mode!r}")


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow (``pip install 'nemo-tlt[mlflow]'``). ``tracking_uri`` unset: MLflow's own
    (``MLFLOW_TRACKING_URI``, else its default); ``run_name`` unset: the run folder."""

    enabled: bool = False
    tracking_uri: Optional[str] = None
    experiment: str = "nemo-tlt"
    run_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.experiment:
            raise ValueError("MlflowConfig.experiment must not be empty")
        if self.tracking_uri is not None and not self.tracking_uri:
            raise ValueError("MlflowConfig.tracking_uri must be a URI (file:/path, http://host:5000, ...) or null")


@dataclass(frozen=True)
class LoggerConfig:
    """The ``logger:`` block: metrics.jsonl always; TensorBoard, W&B, MLflow as chosen."""

    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass(frozen=True)
class DebugConfig:
    """The ``debug:`` block. ``weight_digests``: hash the weights each rank syncs to its engine
    (SHA-256 of every tensor's bytes, copied to the host) every N steps and at the run's last
    configured step (``steps - 1``; a run stopped early by its time limit hashes its last
    completed step only if it falls on a multiple of N), so that ``replicas_identical`` (every rank the same policy and drafter bits) and the
    report's ``final_policy_identical`` (TLT and baseline end with the same policy) are checked;
    0: never (those figures are then null). Its cost is in each record's ``weight_digest_s``,
    part of ``weight_sync_s``: it grows with the model (every byte hashed on the host)."""

    weight_digests: int = 0

    def __post_init__(self) -> None:
        check_int("debug.weight_digests", self.weight_digests, 0)

    def digest_at(self, step: int, last_step: int) -> bool:
        """Whether step ``step`` (of a run whose last step is ``last_step``) hashes its weights."""
        n = self.weight_digests
        return n > 0 and (step % n == 0 or step == last_step)


@dataclass(frozen=True)
class TLTConfig:
    run_dir: str = "runs/demo"
    seed: int = 0
    steps: int = 4
    resume: bool = False
    progress: bool = True
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # the RL algorithm (nemo_tlt.algorithms.registry.ALGORITHMS: grpo | dapo | rloo, or an
    # import path) and its factory's keyword arguments
    algorithm: str = "grpo"
    algorithm_options: Dict[str, Any] = field(default_factory=dict)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    drafter: IdleDrafterConfig = field(default_factory=IdleDrafterConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        check_int("seed", self.seed, 0, 2**31 - 1)
        check_int("steps", self.steps, 1)
        self._check_algorithm()
        world = self.workers.num_workers
        if self.policy.backend == "megatron":
            if world < 2:
                raise ValueError("policy.backend=megatron needs workers.num_workers >= 2 (a gloo process group)")
            mp = self.policy.tensor_parallel * self.policy.pipeline_parallel
            if world % mp:
                raise ValueError(f"workers.num_workers={world} must be a multiple of "
                                 f"policy.tensor_parallel x policy.pipeline_parallel = {mp}")
        if self.drafter.min_idle_workers > world:
            raise ValueError(f"drafter.min_idle_workers={self.drafter.min_idle_workers} exceeds "
                             f"workers.num_workers={world}")
        if self.validation.options and self.task.source in TASK_SOURCE_OPTIONS:
            _check_builtin_options(self.task.source, {**self.task.options, **self.validation.options},
                                   "validation.options")
        rollout_tp = self.rollout.tensor_parallel
        if world % rollout_tp:
            raise ValueError(f"rollout.tensor_parallel={rollout_tp} must divide workers.num_workers={world} "
                             "(consecutive ranks form one rollout replica)")
        replicas = world // rollout_tp
        if self.grpo.prompts_per_step < replicas:
            raise ValueError(f"grpo.prompts_per_step={self.grpo.prompts_per_step} leaves a rollout replica without "
                             f"prompts (workers.num_workers={world} / rollout.tensor_parallel={rollout_tp} = "
                             f"{replicas} replicas); each replica takes whole groups")

        if self.rollout.engine == "vllm":
            self._check_vllm()

    def _check_algorithm(self) -> None:
        """A registered algorithm is built now with its options and run on one group of the
        run's size; one named by import path is when the run starts (``nemo_tlt.train``)."""
        ALGORITHMS.check(self.algorithm)
        _check_options("algorithm_options", self.algorithm_options)
        object.__setattr__(self, "algorithm_options", dict(self.algorithm_options))
        if self.algorithm in ALGORITHMS:
            check_algorithm(self.algorithm, self.algorithm_options, self.grpo.group_size, self.grpo.max_new_tokens)

    def _check_vllm(self) -> None:
        """What vLLM cannot do (its engine's declared ``LIMITS``), refused by the keys that ask
        for it (docs/vllm.md)."""
        from nemo_tlt.rollout.run_limits import TrainRunAsks, unsupported_settings
        from nemo_tlt.rollout.vllm_config import vllm_cpu_build
        from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine  # its LIMITS; vLLM is imported lazily

        lines = unsupported_settings("vllm", VLLMRolloutEngine.LIMITS, TrainRunAsks.of(self))
        serve = self.drafter.serve_dtype
        if serve not in ("float32", self.model.dtype):
            lines.append(f"drafter.serve_dtype={serve} with model.dtype={self.model.dtype}: vLLM builds its drafter in "
                         "the target's dtype (model.dtype) whatever the exported folder says; set drafter.serve_dtype "
                         "to float32 (the default) or to model.dtype")
        if self.rollout.vllm.enable_sleep_mode and vllm_cpu_build():
            lines.append("rollout.vllm.enable_sleep_mode with the vllm-cpu build: vLLM's sleep mode runs on CUDA "
                         "only (vLLM refuses it on its CPU build)")
        if lines:
            raise ValueError("; ".join(lines))

    def baseline(self) -> "TLTConfig":
        """The same run without TLT: plain decoding, no drafter training."""
        return replace(self, rollout=replace(self.rollout, sd_enabled=False),
                       drafter=replace(self.drafter, train_on_idle=False))

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able values (tree shapes in their string form), as load_config reads them."""
        return plain_values(self)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))


def plain_values(value: Any) -> Any:
    """A config (or any value) as plain YAML-able values; tree shapes in their string form."""
    if isinstance(value, TreeShape):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_values(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain_values(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_values(v) for k, v in value.items()}
    return value


ENGINE_OVERRIDES = "engine_overrides"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TLTConfig:
    """defaults <- YAML file <- the file's ``engine_overrides`` for the run's engine <-
    ``key=value`` overrides, typed and validated (see `engine_overrides`)."""
    return load_structured(TLTConfig, path, [*engine_overrides(path, overrides), *overrides],
                           drop=(ENGINE_OVERRIDES,))


def engine_overrides(path: str | Path | None, overrides: Sequence[str] = ()) -> list[str]:
    """The overrides a YAML file gives for the rollout engine the run ends up with.

    A file may hold ``engine_overrides: {<engine>: [key=value, ...]}``: what the run changes
    when ``rollout.engine`` (the command line's, else the file's, else ``torch``) names that
    engine, applied after the file and before the command line's overrides (which win). It is
    how one config serves engines that cannot all do the same (vLLM: no coupled sampling,
    no hidden states); the run's saved config holds the values applied."""
    if path is None or not Path(path).is_file():
        return []
    loaded = OmegaConf.load(path)
    block = loaded.get(ENGINE_OVERRIDES) if isinstance(loaded, DictConfig) else None
    if block is None:
        return []
    where = f"{path}: {ENGINE_OVERRIDES}"
    if not isinstance(block, DictConfig):
        raise ValueError(f"{where} must be a mapping from engine name to a list of key=value overrides")
    for engine, items in block.items():
        try:
            ENGINES.check(engine)
        except ValueError as err:
            raise ValueError(f"{where}.{engine}: not a rollout engine ({err})") from None
        if not isinstance(items, ListConfig) or not all(isinstance(i, str) and "=" in i for i in items):
            raise ValueError(f"{where}.{engine} must be a list of key=value strings, got {items!r}")
        if any(parse_override(i)[1] == "rollout.engine" for i in items):
            raise ValueError(f"{where}.{engine} may not set rollout.engine (it is chosen by the file or the "
                             "command line)")
    # the engine as the run will have it: the file and the command line merged as load_config does
    engine = merge_structured(TLTConfig, path, overrides, drop=(ENGINE_OVERRIDES,)).rollout.engine
    return list(block.get(engine, []))
