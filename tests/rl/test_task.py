"""The task interfaces: Prompt, JSONL source, HF tokenizer, import paths, TaskConfig, build_task."""
from __future__ import annotations

import json
import pickle
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from nemo_tlt.config import TaskConfig
from nemo_tlt.imports import load_object
from nemo_tlt.rl.data.task import (
    HFTokenizer,
    JsonlTaskSource,
    Prompt,
    TaskSource,
    Tokenizer,
    build_task,
    check_vocab,
)

HERE = __name__  # this module's import name under pytest, for import paths to the functions below


def exact_match(prompt: Prompt, response: str, bonus: float = 0.0) -> float:
    """A user's reward: 1 for the exact answer, ``bonus`` for any other non-empty answer."""
    if response.strip() == prompt.answer:
        return 1.0
    return bonus if response.strip() else 0.0


def not_a_number(prompt: Prompt, response: str) -> float:
    return float("nan")


def not_a_source(**options):
    return object()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- Prompt -----------------------------------------------------------------

def test_prompt_meta_is_a_private_read_only_copy_and_pickles():
    meta = {"tests": [1, 2]}
    p = Prompt("2+2=", "4", meta)
    meta["other"] = 1
    assert dict(p.meta) == {"tests": [1, 2]}
    with pytest.raises(TypeError):
        p.meta["x"] = 1
    assert Prompt("a").meta == {} and Prompt("a").answer is None
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(Prompt("2+2=", "4"))
    with pytest.raises(ValueError, match="Prompt.answer"):
        Prompt("2+2=", 4)


# ---- JsonlTaskSource --------------------------------------------------------

@pytest.fixture
def jsonl(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": i, "id": f"r{i}"} for i in range(10)]
    rows[3] = {"prompt": "q3"}  # no answer
    rows[4] = {"prompt": "q4", "answer": None}
    rows[5] = {"prompt": "q5", "answer": "five"}
    rows[6] = {"prompt": "q6", "answer": True}
    rows[7] = {"prompt": "q7", "answer": 2.5}
    return write_jsonl(tmp_path / "prompts.jsonl", rows[:5] + [""] + rows[5:])  # a blank line is skipped


def test_jsonl_reads_rows_answers_and_meta(jsonl):
    src = JsonlTaskSource(jsonl)
    assert isinstance(src, TaskSource) and len(src) == 10
    by_text = {p.text: p for p in src.rows}
    assert by_text["q0"] == Prompt("q0", "0", {"id": "r0"})
    assert by_text["q3"].answer is None and by_text["q4"].answer is None
    assert [by_text[q].answer for q in ("q5", "q6", "q7")] == ["five", "true", "2.5"]


def test_jsonl_random_draws_depend_on_rng_only_without_replacement_within_a_step(jsonl):
    src = JsonlTaskSource(jsonl, order="random")
    a = src.prompts(3, 6, np.random.default_rng([0, 3, 0x71]))
    assert a == JsonlTaskSource(jsonl, order="random").prompts(3, 6, np.random.default_rng([0, 3, 0x71]))
    assert a == src.prompts(99, 6, np.random.default_rng([0, 3, 0x71]))  # step is not a second source of randomness
    assert len({p.text for p in a}) == 6
    assert a != src.prompts(4, 6, np.random.default_rng([0, 4, 0x71]))
    full = src.prompts(0, 10, np.random.default_rng(1))
    assert sorted(p.text for p in full) == sorted(p.text for p in src.rows)
    many = src.prompts(0, 25, np.random.default_rng(1))
    assert len(many) == 25 and {p.text for p in many} <= {p.text for p in src.rows}
    assert src.prompts(0, 0, np.random.default_rng(1)) == []


def test_jsonl_epochs_read_every_row_once_per_epoch_as_a_function_of_seed_and_step(jsonl):
    src = JsonlTaskSource(jsonl, shuffle_seed=5)  # order=epochs is the default
    assert src.order == "epochs"
    n, rows = 4, len(src)

    def step(k, source=src, rng_seed=0):
        return [p.text for p in source.prompts(k, n, np.random.default_rng(rng_seed))]
    stream = [t for k in range(5) for t in step(k)]  # 20 positions: epochs 0 and 1 of 10 rows
    assert sorted(stream[:rows]) == sorted(p.text for p in src.rows)  # without replacement
    assert sorted(stream[rows:2 * rows]) == sorted(p.text for p in src.rows)
    assert stream[:rows] != stream[rows:2 * rows]  # each epoch its own shuffle
    # a resumed run (a fresh source, any generator) draws the same prompts at the same step
    assert step(3) == step(3, JsonlTaskSource(jsonl, shuffle_seed=5), 99)
    assert step(3) != step(3, JsonlTaskSource(jsonl, shuffle_seed=6))  # the stated seed decides
    with pytest.raises(ValueError, match=r"task.options.order must be one of \['epochs', 'random'\]"):
        JsonlTaskSource(jsonl, order="sorted")


def test_jsonl_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "why", "label": 7, "prompt": "kept as meta"}])
    (p,) = JsonlTaskSource(path, prompt_key="question", answer_key="label").rows
    assert p == Prompt("why", "7", {"prompt": "kept as meta"})


@pytest.mark.parametrize("bad, message", [
    ("{not json", r"q\.jsonl:2: not valid JSON"),
    ("[1, 2]", r"q\.jsonl:2: expected a JSON object"),
    ({"answer": 1}, r"q\.jsonl:2: missing key 'prompt'"),
    ({"prompt": 5}, r"q\.jsonl:2: key 'prompt' must be a non-empty string"),
    ({"prompt": ""}, r"q\.jsonl:2: key 'prompt' must be a non-empty string"),
    ({"prompt": "x", "answer": [1]}, r"q\.jsonl:2: key 'answer' must be a JSON scalar"),
])
def test_jsonl_bad_line_names_file_line_and_key(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(ValueError, match=message):
        JsonlTaskSource(path)


def test_jsonl_refuses_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no prompts"):
        JsonlTaskSource(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"cannot read .*missing\.jsonl"):
        JsonlTaskSource(tmp_path / "missing.jsonl")


# ---- HFTokenizer ------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A real transformers tokenizer (char-level WordLevel) saved with save_pretrained, built offline."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.decoders import Fuse
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate("0123456789+=#")}}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = Split("", behavior="isolated")  # one token per character
    raw.decoder = Fuse()  # and back without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(folder)
    return folder


def test_hf_tokenizer_from_a_saved_folder(hf_folder):
    tok = HFTokenizer.from_folder(hf_folder)
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (16, 1, 2)
    ids = tok.encode("12+3=")
    assert ids == [4, 5, 13, 6, 14]
    assert tok.encode("12+3=", add_bos=True) == [1, *ids]
    assert tok.decode(ids) == "12+3="
    assert tok.decode([*tok.encode("#15"), 2, 4, 4]) == "#15"  # stops at EOS


CHAT = ("{% for m in messages %}<s>{{ m['role'][0] }}={{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>a={% endif %}")


@pytest.fixture(scope="module")
def chat_folder(hf_folder, tmp_path_factory):
    """The tokenizer of hf_folder with a chat template (roles by their first letter)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(hf_folder), local_files_only=True)
    tok.add_tokens(["u", "s", "a", "y"])
    tok.chat_template = CHAT
    folder = tmp_path_factory.mktemp("hf_chat")
    tok.save_pretrained(folder)
    return folder


def test_hf_tokenizer_applies_the_chat_template_when_asked(chat_folder, hf_folder):
    tok = HFTokenizer.from_folder(chat_folder, chat_template=True)
    raw = tok.tokenizer
    expected = raw.encode(raw.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
    assert expected[0] == tok.bos_id and raw.decode(expected) == "<s>u=1+2=</s><s>a="
    assert tok.encode("1+2=") == expected
    assert tok.encode("1+2=", add_bos=True) == expected  # the template's own BOS, not a second one
    assert HFTokenizer.from_folder(chat_folder).encode("1+2=") == raw.encode("1+2=", add_special_tokens=False)
    sys_tok = HFTokenizer.from_folder(chat_folder, chat_template=True, system_prompt="3")
    assert raw.decode(sys_tok.encode("1+2=")) == "<s>s=3</s><s>u=1+2=</s><s>a="
    with pytest.raises(ValueError, match="task.chat_template=true: the tokenizer in .* has no chat template"):
        HFTokenizer.from_folder(hf_folder, chat_template=True)


def test_build_task_passes_the_chat_template_options(tmp_path, chat_folder):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1=", "answer": 2}])
    cfg = TaskConfig(source="jsonl", options={"path": str(path)}, reward=f"{HERE}:exact_match", tokenizer="hf",
                     chat_template=True, system_prompt="3")
    tok = build_task(cfg, str(chat_folder)).tokenizer
    assert tok.tokenizer.decode(tok.encode("1+1=")) == "<s>s=3</s><s>u=1+1=</s><s>a="


def test_hf_tokenizer_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"no tokenizer in {tmp_path}: looked for .*tokenizer\.json"):
        HFTokenizer.from_folder(tmp_path)


def test_hf_tokenizer_without_transformers_names_the_extra(hf_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"nemo-tlt\[hf\]"):
        HFTokenizer.from_folder(hf_folder)


# ---- load_object ------------------------------------------------------------

def test_load_object_resolves_dotted_attributes():
    assert load_object("nemo_tlt.rl.data.task:JsonlTaskSource", "task.source") is JsonlTaskSource
    assert load_object("nemo_tlt.rl.data.task:HFTokenizer.from_folder", "task.tokenizer") == HFTokenizer.from_folder


@pytest.mark.parametrize("spec, message", [
    ("nemo_tlt.rl.data.task", "must be an import path"),
    ("nemo_tlt.rl.data.task:a:b", "must be an import path"),
    ("nemo_tlt..task:x", "must be an import path"),
    ("", "must be an import path"),
    ("nemo_tlt.no_such_module:x", "cannot import module 'nemo_tlt.no_such_module'"),
    ("nemo_tlt.rl.data.task:no_such_attr", "has no attribute 'no_such_attr'"),
])
def test_load_object_errors_name_field_and_spec(spec, message):
    with pytest.raises(ValueError, match=f"task.reward.*{message}") as err:
        load_object(spec, "task.reward")
    assert repr(spec) in str(err.value) or spec == ""


# ---- TaskConfig -------------------------------------------------------------

def test_task_config_is_an_omegaconf_structured_config(tmp_path):
    merged = OmegaConf.merge(OmegaConf.structured(TaskConfig),
                             OmegaConf.create({"source": "jsonl", "options": {"path": str(tmp_path / "q.jsonl")},
                                               "reward_options": {"bonus": 0.1}}))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, TaskConfig) and cfg.options == {"path": str(tmp_path / "q.jsonl")}
    assert type(cfg.options) is dict and cfg.reward_options == {"bonus": 0.1}


def test_task_config_keeps_its_own_copy_of_the_options():
    options, reward_options = {"path": "a.jsonl"}, {"bonus": 0.1}
    cfg = TaskConfig(source="jsonl", options=options, reward_options=reward_options)
    options["path"], reward_options["bonus"] = "b.jsonl", 0.2
    assert cfg.options == {"path": "a.jsonl"} and cfg.reward_options == {"bonus": 0.1}


@pytest.mark.parametrize("kwargs, message", [
    ({"source": "no_colon"}, "task.source must be 'jsonl', 'datasets' or an import path"),
    ({"source": "datasets"}, "task.options.path is required with task.source='datasets'"),
    ({"source": "jsonl", "options": {"path": "p", "format": "json"}}, r"task.options has keys \['format'\]"),
    ({"source": "jsonl", "options": {"path": "p", "order": "shuffled"}},
     r"task.options.order must be one of \['epochs', 'random'\]"),
    ({"source": "datasets", "options": {"path": "p", "shuffle_seed": -1}}, r"task.options.shuffle_seed must be >= 0"),
    ({"chat_template": True}, "task.chat_template=true needs task.tokenizer='hf'"),
    ({"tokenizer": "hf", "system_prompt": "be brief"}, "task.system_prompt .* needs task.chat_template=true"),
    ({"source": "jsonl"}, "task.options.path is required"),
    ({"source": "jsonl", "options": {"path": "p", "prompt": "x"}}, r"task.options has keys \['prompt'\]"),
    ({"source": "jsonl", "options": {"path": 3}}, "task.options.path must be a non-empty string"),
    ({"source": "jsonl", "options": {"path": "p", "answer_key": ""}}, "task.options.answer_key must be"),
    ({"options": [1]}, "task.options must be a mapping"),
    ({"reward_options": {1: 2}}, "task.reward_options must be a mapping"),
    ({"reward": "rewards.py"}, "task.reward must be an import path"),
    ({"tokenizer": "HF"}, "task.tokenizer must be 'hf' or an import path"),
])
def test_task_config_validation_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(**kwargs)


# ---- build_task -------------------------------------------------------------

def test_build_task_with_the_demo_defaults(tmp_path):
    task = build_task(TaskConfig(), str(tmp_path))
    (prompt,) = task.source.prompts(0, 1, np.random.default_rng(0))
    assert task.reward(prompt, prompt.meta["solution"]) == 1.0
    assert task.reward(prompt, prompt.meta["solution"] + "1") == 0.0
    assert task.tokenizer.decode(task.tokenizer.encode(prompt.text)) == prompt.text
    check_vocab(task.tokenizer, task.tokenizer.vocab_size, str(tmp_path))


def test_build_task_jsonl_with_a_user_reward_and_hf_tokenizer(tmp_path, hf_folder):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+3=", "answer": 5}])
    cfg = TaskConfig(source="jsonl", options={"path": str(path)}, reward=f"{HERE}:exact_match",
                     reward_options={"bonus": 0.25}, tokenizer="hf")
    task = build_task(cfg, str(hf_folder))
    assert isinstance(task.source, JsonlTaskSource) and isinstance(task.tokenizer, HFTokenizer)
    prompts = task.source.prompts(0, 2, np.random.default_rng(0))
    assert sorted(p.text for p in prompts) == ["1+1=", "2+3="]
    p = next(p for p in prompts if p.text == "1+1=")
    assert [task.reward(p, r) for r in ("2", "3", "")] == [1.0, 0.25, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"source": "nemo_tlt.no_such:Source"}, "task.source='nemo_tlt.no_such:Source': cannot import"),
    ({"source": f"{HERE}:HERE"}, "task.source=.* is not callable"),
    ({"source": f"{HERE}:not_a_source"}, "task.source=.* returned object, which has no prompts"),
    ({"options": {"nme": "arith"}}, r"task.options has keys \['nme'\]"),
    ({"source": "nemo_tlt.rl.data.task:JsonlTaskSource", "options": {"file": "x"}}, "task.options: .* cannot be called"),
    ({"options": {"max_value": 5}}, r"task.options.max_value must be an int in \[9, 999\]"),
    ({"reward": "nemo_tlt.demo.rewards:no_such"}, "task.reward=.*has no attribute"),
    ({"reward_options": {"bonus": 0.1}}, "task.reward_options: .*arith_reward.* cannot be called"),
    ({"tokenizer": "hf"}, "task.tokenizer='hf': no tokenizer in"),
    ({"tokenizer": "nemo_tlt.rl.data.task:Prompt"}, "task.tokenizer: .* cannot be called"),
    ({"tokenizer": "nemo_tlt.demo.tasks:ArithTaskSource"}, "task.tokenizer=.* lacks the Tokenizer interface"),
])
def test_build_task_errors_name_the_key(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_task(TaskConfig(**kwargs), str(tmp_path))


def test_reward_must_return_a_finite_number(tmp_path):
    task = build_task(TaskConfig(reward=f"{HERE}:not_a_number"), str(tmp_path))
    with pytest.raises(ValueError, match="task.reward=.*returned nan"):
        task.reward(Prompt("1+1=", "2"), "#2")


def exact_with_accuracy(prompt: Prompt, response: str) -> float:
    return 1.0 if response.strip() == prompt.answer else 0.0


exact_with_accuracy.correct_at = 1.0


def bad_correct_at(prompt: Prompt, response: str) -> float:
    return 0.0


bad_correct_at.correct_at = "yes"


def test_a_reward_says_what_correct_scores(tmp_path):
    assert build_task(TaskConfig(reward=f"{HERE}:exact_with_accuracy"), str(tmp_path)).reward.correct_at == 1.0
    assert build_task(TaskConfig(reward=f"{HERE}:exact_match"), str(tmp_path)).reward.correct_at is None
    with pytest.raises(ValueError, match="task.reward=.*bad_correct_at.*correct_at attribute must be a finite float"):
        build_task(TaskConfig(reward=f"{HERE}:bad_correct_at"), str(tmp_path))


def test_check_vocab_names_both_sizes(tmp_path):
    tok = build_task(TaskConfig(), str(tmp_path)).tokenizer
    check_vocab(tok, tok.vocab_size, "m")
    check_vocab(tok, tok.vocab_size + 7, "m")  # a padded embedding is fine
    v = tok.vocab_size
    with pytest.raises(ValueError, match=rf"vocab_size {v} exceeds the model's vocab_size {v - 1} \(m\)"):
        check_vocab(tok, v - 1, "m")


def test_the_task_interfaces_do_not_import_the_demo():
    import subprocess

    code = ("import sys, nemo_tlt.rl.data.task; "
            "sys.exit(sorted(m for m in sys.modules if m.startswith('nemo_tlt.demo')) or 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_check_eos_refuses_a_tokenizer_whose_eos_is_not_the_models():
    from nemo_tlt.rl.data.task import check_eos

    class Tok:
        eos_id = 3

    check_eos(Tok(), 3, "m")
    with pytest.raises(ValueError, match="eos id 3 differs from the model's eos_token_id 2"):
        check_eos(Tok(), 2, "m")
