"""Where a run's scalar metrics go besides ``metrics.jsonl``: TensorBoard, Weights &
Biases, MLflow; the ``logger:`` config block.

Contract
--------
* A sink takes ``log(scalars, step)`` (a flat ``{name: float}`` of one step, names
  like ``tlt/reward_mean`` or ``tlt/validation/mean_reward``) and ``close()``.
  :class:`~nemo_tlt.rl.reporting.report.MetricsWriter` (rank 0) turns each record into scalars
  and hands them to every sink :func:`build_sinks` made from :class:`LoggerConfig`,
  so every sink receives exactly the numbers ``metrics.jsonl`` holds.
* W&B and MLflow are optional extras (``pip install 'nemo-tlt[wandb]'``,
  ``'nemo-tlt[mlflow]'``), imported only when chosen; chosen but missing raises an
  ``ImportError`` naming the extra. :func:`check_available` does that check up front.
* W&B writes its files under the run folder (``<run>/wandb``); ``mode: offline`` (or
  ``WANDB_MODE=offline`` with ``mode`` unset) needs no network (``wandb sync`` uploads
  later). MLflow talks to ``tracking_uri`` through ``MlflowClient`` (no global active
  run); a ``file:`` URI is the file store, which MLflow >= 3 refuses unless
  ``MLFLOW_ALLOW_FILE_STORE=true``: naming a ``file:`` URI in the config is taken as
  that opt-in, and the variable is set for this process unless the user set it.
* A resumed run starts a new W&B / MLflow run that continues at the resumed step
  (``metrics.jsonl`` is the one record of the whole run).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from nemo_tlt.config import LoggerConfig, MlflowConfig, WandbConfig

class ScalarSink(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _require(module: str, extra: str, key: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{key}=true needs {module}: pip install 'nemo-tlt[{extra}]' [{err}]") from err


def check_available(cfg: LoggerConfig) -> None:
    """Import the chosen optional loggers now (at the start of a run), so a missing extra
    fails before any step runs."""
    if cfg.wandb.enabled:
        _require("wandb", "wandb", "logger.wandb.enabled")
    if cfg.mlflow.enabled:
        _require("mlflow", "mlflow", "logger.mlflow.enabled")


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only where a run logs
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: WandbConfig, out_dir: Path, name: str, config: dict[str, Any] | None) -> None:
        wandb = _require("wandb", "wandb", "logger.wandb.enabled")
        kwargs = {"mode": cfg.mode} if cfg.mode is not None else {}
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or name, dir=str(out_dir),
                              config=config, reinit="create_new", **kwargs)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, cfg: MlflowConfig, name: str, params: dict[str, Any] | None) -> None:
        _require("mlflow", "mlflow", "logger.mlflow.enabled")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        if cfg.tracking_uri is not None and cfg.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the config chose the file store
        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or name).info.run_id
        if params:
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(name, float(value), now, step) for name, value in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (config values as MLflow params)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def build_sinks(cfg: LoggerConfig, out_dir: str | Path, name: str,
                config: dict[str, Any] | None = None) -> list[ScalarSink]:
    """The sinks ``cfg`` chooses for one run folder; ``config`` (plain values) goes to
    W&B as the run config and to MLflow as flattened params."""
    out = Path(out_dir)
    sinks: list[ScalarSink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(out / "tb"))
    if cfg.wandb.enabled:
        sinks.append(WandbSink(cfg.wandb, out, name, config))
    if cfg.mlflow.enabled:
        sinks.append(MlflowSink(cfg.mlflow, name, flatten(config) if config else None))
    return sinks


def finite_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite real numbers of ``values`` (bools and everything else left out)."""
    return {k: float(v) for k, v in values.items()
            if not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)}
