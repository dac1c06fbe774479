"""The logger: block: TensorBoard, W&B (offline) and MLflow (file store) receive exactly
the numbers metrics.jsonl holds, step and validation records alike; a chosen logger whose
extra is missing fails naming the extra."""
from __future__ import annotations

import re
import struct
import sys

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.rl.reporting.loggers import LoggerConfig, MlflowConfig, WandbConfig, check_available
from nemo_tlt.rl.reporting.report import MetricsWriter, read_metrics, record_scalars

pytestmark = pytest.mark.timeout(180)


def _records() -> list[dict]:
    """Two step records shaped like the loop's (lists and strings are not scalars) and a
    validation record after the second."""
    def step(k: int) -> dict:
        return {"step": k, "mode": "tlt", "reward_mean": 0.25 * k, "step_s": 1.5 + k, "sd_steps": 3 * k,
                "mean_accept_len": float("nan") if k == 0 else 2.5, "rewards": [0.0, 1.0], "timeline": [],
                "rollout_digest": "ab12", "drafter_round_skipped": False}
    validation = {"step": 1, "mode": "tlt", "split": "validation", "mean_reward": 0.75, "accuracy": 0.5,
                  "mean_response_len": 12.0, "num_prompts": 4}
    return [step(0), step(1), validation]


def _by_step(path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as the scalars each step logged, merged over its records."""
    out: dict[int, dict[str, float]] = {}
    for record in read_metrics(path):
        out.setdefault(record["step"], {}).update(record_scalars(record))
    return out


def test_record_scalars_names_and_filters():
    step, _, validation = _records()
    assert record_scalars(step) == {"tlt/reward_mean": 0.0, "tlt/step_s": 1.5, "tlt/sd_steps": 0.0}
    assert record_scalars(validation) == {"tlt/validation/mean_reward": 0.75, "tlt/validation/accuracy": 0.5,
                                          "tlt/validation/mean_response_len": 12.0,
                                          "tlt/validation/num_prompts": 4.0}


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    """The history rows of an offline W&B run file (the LevelDB-log framing W&B writes:
    a 7-byte ':W&B' header, 32 KiB blocks of chunks with crc / length / type headers)."""
    import json
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, chunks, rows = run_file.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                rows[int(items["_step"])] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_wandb_offline_mlflow_file_store_and_tensorboard_log_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # mode unset in the config: W&B's own choice
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()  # file:///...: MLflow's file store
    cfg = load_config(None, ["logger.wandb.enabled=true", "logger.wandb.project=tests",
                             "logger.mlflow.enabled=true", f"logger.mlflow.tracking_uri={uri}",
                             "logger.mlflow.experiment=tests"])
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, logger=cfg.logger, name="run-under-test", config={"seed": 0, "grpo": {"x": 1}})
    for record in _records():
        writer.write(record)
    writer.close()
    expected = _by_step(run_dir / "metrics.jsonl")
    assert expected[1]["tlt/validation/mean_reward"] == 0.75 and "tlt/mean_accept_len" not in expected[0]

    run_files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # under the run folder
    assert len(run_files) == 1
    assert _wandb_history(run_files[0]) == expected

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-under-test" and run.data.params["grpo.x"] == "1"
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert got == expected

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tb: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            tb.setdefault(e.step, {})[tag] = e.value
    assert tb.keys() == expected.keys()
    for step, scalars in expected.items():
        assert tb[step] == pytest.approx(scalars)  # TensorBoard stores float32


def test_tensorboard_off_writes_no_events(tmp_path):
    writer = MetricsWriter(tmp_path, logger=LoggerConfig(tensorboard=False))
    writer.write(_records()[0])
    writer.close()
    assert not (tmp_path / "tb").exists() and len(read_metrics(tmp_path / "metrics.jsonl")) == 1


@pytest.mark.parametrize("module, cfg, extra", [
    ("wandb", LoggerConfig(wandb=WandbConfig(enabled=True)), "nemo-tlt[wandb]"),
    ("mlflow", LoggerConfig(mlflow=MlflowConfig(enabled=True)), "nemo-tlt[mlflow]"),
])
def test_a_chosen_logger_without_its_extra_names_the_extra(tmp_path, monkeypatch, module, cfg, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    needs = rf"logger\.{module}\.enabled=true needs {module}: pip install '{re.escape(extra)}'"
    with pytest.raises(ImportError, match=needs):
        check_available(cfg)
    with pytest.raises(ImportError, match=rf"pip install '{re.escape(extra)}'"):
        MetricsWriter(tmp_path, logger=cfg)
    check_available(LoggerConfig())  # nothing optional chosen: nothing imported


@pytest.mark.parametrize("override, message", [
    ("logger.wandb.mode=cloud", r"logger\.wandb\.mode must be one of \['online', 'offline', 'disabled'\]"),
    ("logger.wandb.project=''", r"logger\.wandb\.project must not be empty"),
    ("logger.mlflow.experiment=''", r"logger\.mlflow\.experiment must not be empty"),
    ("logger.mlflow.bogus=1", r"'logger\.mlflow\.bogus'"),
    ("logger.tensorboard=sometimes", r"'logger\.tensorboard'"),
])
def test_logger_config_errors_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])
