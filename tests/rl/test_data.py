"""task.source: datasets (local json / jsonl / parquet with column mapping) and the
validation pass (nemo_tlt.rl.data.validation) with its config block."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from nemo_tlt.config import TaskConfig, load_config
from nemo_tlt.rl.run import shard_prompts
from nemo_tlt.rl.data.task import Prompt, build_task
from nemo_tlt.rl.data.validation import (
    ValidationShard,
    _decode_share,
    is_due,
    validate,
    validation_prompts,
    validation_record,
    validation_sampling,
)
from nemo_tlt.rollout.protocol import GenerationStats, GenerateOutput, RequestResult

ROWS = [{"question": f"{i}+1=", "solution": i + 1, "source": "train"} for i in range(6)]


def exact(prompt: Prompt, response: str) -> float:
    return 1.0 if response == prompt.answer else 0.0


exact.correct_at = 1.0


def halves(prompt: Prompt, response: str) -> float:
    return 0.5 if response == prompt.answer else 0.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("datasets")
    pd = pytest.importorskip("pandas")
    d = tmp_path_factory.mktemp("data")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (d / "train.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_parquet(d / "train.parquet")
    pd.DataFrame([{"question": "7+1=", "solution": 8}, {"question": "8+1=", "solution": 9}]).to_parquet(d / "val.parquet")
    return d


@pytest.mark.parametrize("name", ["train.jsonl", "train.json", "train.parquet"])
def test_datasets_files_with_column_mapping(files, name):
    cfg = TaskConfig(source="datasets", options={"path": str(files / name), "prompt_key": "question",
                                                 "answer_key": "solution", "shuffle_seed": 3},
                     reward=f"{__name__}:exact")
    source = build_task(cfg, str(files)).source
    assert len(source) == 6
    assert source.rows[2] == Prompt("2+1=", "3", {"source": "train"})
    steps = [p.text for k in range(3) for p in source.prompts(k, 2, np.random.default_rng(k))]
    assert sorted(steps) == sorted(r["question"] for r in ROWS)  # one epoch, without replacement


def test_datasets_source_errors_name_file_row_and_column(files, tmp_path):
    from nemo_tlt.rl.data.data_sources import DatasetsTaskSource
    with pytest.raises(ValueError, match=r"train\.jsonl: no column 'prompt' \(task\.options\.prompt_key.*"
                                         r"columns: \['question', 'solution', 'source'\]"):
        DatasetsTaskSource(files / "train.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "a", "solution": 1}) + "\n" + json.dumps({"question": "", "solution": 2}))
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: column 'question' must be a non-empty string"):
        DatasetsTaskSource(bad, prompt_key="question")
    with pytest.raises(ValueError, match=r"task\.options\.format must be one of \['json', 'parquet'\]"):
        DatasetsTaskSource(files / "train.jsonl", format="csv")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"task\.options\.format must be one of .*for .*data\.txt"):
        DatasetsTaskSource(tmp_path / "data.txt")
    with pytest.raises(ValueError, match=r"task\.options\.path: .*missing\.parquet is not a file"):
        DatasetsTaskSource(tmp_path / "missing.parquet")


def test_datasets_source_without_the_package_names_the_extra(files, monkeypatch):
    from nemo_tlt.rl.data.data_sources import DatasetsTaskSource
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'nemo-tlt\[datasets\]'"):
        DatasetsTaskSource(files / "train.jsonl", prompt_key="question")


# ---- validation --------------------------------------------------------------

class EchoEngine:
    """Answers each prompt by its seq_id's digits from a table (a stand-in rollout engine)."""

    def __init__(self, tokenizer, answers: dict[int, str]) -> None:
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, requests, sampling, policy=None, return_hidden=False):
        self.calls.append((len(requests), sampling, policy))
        results = [RequestResult(self.tokenizer.encode(self.answers[r.seq_id]) + [self.tokenizer.eos_id], "eos")
                   for r in requests]
        return GenerateOutput(results, GenerationStats())


def _config(files, *extra):
    return load_config(None, ["task.source=datasets", f"task.options.path={files / 'train.parquet'}",
                              "task.options.prompt_key=question", "task.options.answer_key=solution",
                              f"task.reward={__name__}:exact", "validation.every=2",
                              f"validation.options.path={files / 'val.parquet'}", *extra])


def test_validation_record_on_held_out_prompts(files):
    cfg = _config(files)
    assert [is_due(cfg.validation, s) for s in range(5)] == [False, True, False, True, False]
    prompts = validation_prompts(cfg)
    assert sorted(p.text for p in prompts) == ["7+1=", "8+1="]  # every row of the validation file
    assert validation_prompts(cfg) == prompts  # the same at every evaluation
    task = build_task(cfg.task, str(files))
    answers = {i: (p.answer if p.text == "7+1=" else "0") for i, p in enumerate(prompts)}
    engine = EchoEngine(task.tokenizer, answers)
    sampling = validation_sampling(cfg, 3)
    assert sampling.mode == "greedy" and sampling.max_new_tokens == cfg.grpo.max_new_tokens
    record = validate(engine, task, prompts, sampling, 3, "tlt")
    assert record["split"] == "validation" and (record["step"], record["mode"]) == (3, "tlt")
    assert (record["mean_reward"], record["accuracy"], record["num_prompts"]) == (0.5, 0.5, 2)
    assert record["mean_response_len"] == np.mean([len(a) + 1 for a in answers.values()])  # with EOS
    assert engine.calls[0][2] is None  # plain decoding unless an SD policy is passed


def test_validation_shards_add_up_to_the_single_rank_record(files):
    cfg = _config(files, "validation.options.path=" + str(files / "train.parquet"), "validation.num_prompts=5")
    prompts = validation_prompts(cfg)
    assert len(prompts) == 5 and len({p.text for p in prompts}) == 5
    task = build_task(cfg.task, str(files))
    engine = EchoEngine(task.tokenizer, {i: p.answer if i % 2 else "x" for i, p in enumerate(prompts)})
    sampling = validation_sampling(cfg, 1)
    whole = validation_record(1, "baseline", [_decode_share(engine, task, prompts, list(range(5)), sampling, None)],
                              task.reward.correct_at, 0.0)
    parts = [_decode_share(engine, task, prompts, shard_prompts(5, r, 2), sampling, None) for r in range(2)]
    assert validation_record(1, "baseline", parts, task.reward.correct_at, 0.0) == whole
    assert whole["accuracy"] == 0.4


def test_no_accuracy_unless_the_reward_says_what_correct_scores(files):
    cfg = _config(files, f"task.reward={__name__}:halves")
    task = build_task(cfg.task, str(files))
    shard = ValidationShard([0, 1], [0.5, 0.0], [3, 4])
    record = validation_record(0, "tlt", [shard], task.reward.correct_at, 0.0)
    assert "accuracy" not in record and record["mean_reward"] == 0.25


def test_sampled_validation_follows_the_grpo_settings(files):
    cfg = _config(files, "validation.greedy=false", "validation.max_new_tokens=7", "grpo.temperature=0.7")
    s = validation_sampling(cfg, 4)
    assert (s.mode, s.temperature, s.max_new_tokens) == (cfg.grpo.acceptance, 0.7, 7)
    assert s.seed == validation_sampling(cfg, 4).seed != validation_sampling(cfg, 5).seed


@pytest.mark.parametrize("override, message", [
    ("validation.every=-1", r"validation\.every must be >= 0"),
    ("validation.num_prompts=0", r"validation\.num_prompts must be >= 1"),
    ("validation.max_new_tokens=0", r"validation\.max_new_tokens must be >= 1"),
    ("validation.options.colour=red", r"validation\.options has keys \['colour'\]"),
    ("validation.bogus=1", r"'validation\.bogus'"),
])
def test_validation_config_errors_name_the_key(files, override, message):
    with pytest.raises(ValueError, match=message):
        _config(files, override)
