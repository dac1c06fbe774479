"""What a user brings to an RL run: prompts, a tokenizer and a reward.

The loop knows a task only through three small interfaces, so the demo (or any
user's own task) plugs in without the framework importing it:

* :class:`TaskSource` — ``prompts(step, n, rng) -> list[Prompt]``: the ``n``
  prompts of RL step ``step``. They must be a function of the generator's state
  and ``step`` only (no other state, no global RNG): the loop seeds ``rng`` from
  (seed, step), so TLT, its baseline and a resumed run draw the same prompts.
* :class:`Tokenizer` — ``vocab_size``, ``bos_id``, ``eos_id``, ``encode``,
  ``decode`` (contract on the class).
* ``RewardFn`` — ``reward(prompt, response, **options) -> float``, where
  ``response`` is the decoded text generated after the prompt and ``options``
  come from the config (``task.reward_options``). A reward that knows what a correct
  answer scores says so with an attribute ``correct_at`` (a float: a response is
  correct when its reward is >= it); validation then reports accuracy.

:class:`~nemo_tlt.config.TaskConfig` (the ``task:`` block of the top-level config) names them by
import path (``"package.module:attr"``); construction checks only the forms, and
:func:`build_task` does the imports. Built in: ``task.source: jsonl``
(:class:`JsonlTaskSource`), ``task.source: datasets`` (local json / jsonl / parquet
files read with HF ``datasets``: :class:`~nemo_tlt.rl.data.data_sources.DatasetsTaskSource`,
the ``datasets`` extra) and ``task.tokenizer: hf`` (:class:`HFTokenizer`, the tokenizer
saved in the model folder, rendering prompts through its chat template with
``task.chat_template: true``; needs the ``hf`` extra).

Order of the built-in sources (``order`` option): ``epochs`` (default) walks the rows
in epochs without replacement, each epoch a permutation drawn from
(``shuffle_seed``, epoch): step ``s`` of ``n`` prompts takes positions
``[s*n, (s+1)*n)`` of that endless sequence (:func:`epoch_rows`), a function of
(shuffle_seed, step, n) only, so a resumed run repeats the same prompts; ``random``
draws each step's prompts afresh from ``rng`` (with replacement only when ``n``
exceeds the rows).
"""
from __future__ import annotations

import inspect
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from nemo_tlt.config import TASK_DATASETS, TASK_HF, TASK_JSONL, TaskConfig
from nemo_tlt.imports import load_object
from nemo_tlt.rl.data.data_sources import DatasetsTaskSource
# the shared pieces, importable from here as well (a task's own code imports Prompt from this module)
from nemo_tlt.rl.data.prompts import (ORDERS, Prompt, TaskSource, answer_text, check_order, draw_rows,  # noqa: F401
                                 epoch_rows, prompt_from_record)

RewardFn = Callable[..., float]

# Files AutoTokenizer reads a tokenizer from; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, as the loop uses them.

    * ids are ints in ``[0, vocab_size)``; ``vocab_size`` must not exceed the
      model's (:func:`check_vocab`).
    * ``encode(text, add_bos)`` never adds EOS; with ``add_bos`` it starts with
      ``bos_id`` when the tokenizer has one (``bos_id is None``: nothing is added).
    * ``decode(tokens)`` renders generated ids as text, EOS as nothing. The loop
      passes a response's ids up to and including its first EOS, so a tokenizer
      may either stop at EOS (:class:`HFTokenizer`) or merely drop it (the demo's
      ``CharTokenizer``): both give the same text there.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class JsonlTaskSource:
    """Prompts from a JSONL file, read once at construction.

    Each non-blank line is a JSON object with a string ``prompt_key`` and an
    optional ``answer_key`` (a JSON scalar; a number or boolean becomes its JSON
    text, null or absent means no answer); its other keys become ``Prompt.meta``.
    Errors name the file, the line number and the key. ``order`` and
    ``shuffle_seed``: see the module docstring.
    """

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 order: str = "epochs", shuffle_seed: int = 0) -> None:
        check_order(order, shuffle_seed, "JsonlTaskSource")
        self.order, self.shuffle_seed = order, shuffle_seed
        self.path = Path(path)
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"JsonlTaskSource: cannot read {self.path} ({err})") from None
        rows = [self._row(i, line, prompt_key, answer_key) for i, line in enumerate(lines, 1) if line.strip()]
        if not rows:
            raise ValueError(f"JsonlTaskSource: {self.path} holds no prompts (one JSON object per line expected)")
        self.rows: tuple[Prompt, ...] = tuple(rows)

    def _row(self, lineno: int, line: str, prompt_key: str, answer_key: str) -> Prompt:
        where = f"{self.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if prompt_key not in obj:
            raise ValueError(f"{where}: missing key {prompt_key!r} (the prompt text)")
        return prompt_from_record(obj, prompt_key, answer_key, where, "key", "a JSON scalar")

    def __len__(self) -> int:
        return len(self.rows)

    def prompts(self, step: int, n: int, rng: np.random.Generator) -> list[Prompt]:
        picks = draw_rows(len(self.rows), step, n, rng, self.order, self.shuffle_seed, "JsonlTaskSource")
        return [self.rows[i] for i in picks]


# ---- built in: the HF tokenizer saved in a model folder ---------------------

class HFTokenizer:
    """A Hugging Face tokenizer behind the :class:`Tokenizer` contract.

    ``vocab_size`` counts added tokens (``len(tokenizer)``); ``encode`` adds no
    special tokens of its own (BOS only when asked); ``decode`` cuts at the first
    EOS and skips special tokens.

    ``chat_template``: ``encode`` renders the text as one user turn (after a system turn
    when ``system_prompt`` is given) through the tokenizer's chat template with the
    generation prompt (``apply_chat_template``), so the model answers as the assistant;
    the template places its own special tokens, and BOS is added only when asked and the
    template did not start with it.
    """

    def __init__(self, tokenizer: Any, source: str, chat_template: bool = False,
                 system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.chat_template, self.system_prompt = chat_template, system_prompt
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"task.chat_template=true: the tokenizer in {source} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        self.vocab_size = len(tokenizer)
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer in {source} has no EOS token; RL responses need one to end")

    @classmethod
    def from_folder(cls, path: str | Path, chat_template: bool = False,
                    system_prompt: str | None = None) -> "HFTokenizer":
        folder = Path(path)
        if not folder.is_dir() or not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer in {folder}: looked for any of {list(TOKENIZER_FILES)}")
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError("HFTokenizer needs transformers: pip install 'nemo-tlt[hf]' "
                              f"(or transformers>=4.45) [{err}]") from err
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), str(folder),
                   chat_template, system_prompt)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if self.chat_template:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
            text = self.tokenizer.apply_chat_template([*system, {"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id and self.chat_template):
            return [self.bos_id, *ids]
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        ids = [int(t) for t in tokens]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


class BoundReward:
    """A RewardFn with its config options bound: ``reward(prompt, response) -> float``.

    The result must be a finite real number; anything else is refused, naming
    ``task.reward``, rather than let into the advantages.
    """

    def __init__(self, fn: RewardFn, spec: str, options: Mapping[str, Any]) -> None:
        self.fn, self.spec, self.options = fn, spec, dict(options)
        correct_at = getattr(fn, "correct_at", None)
        if correct_at is not None and (isinstance(correct_at, bool) or not isinstance(correct_at, numbers.Real)
                                       or not math.isfinite(correct_at)):
            raise ValueError(f"task.reward={spec!r}: its correct_at attribute must be a finite float "
                             f"(the reward from which a response counts as correct), got {correct_at!r}")
        self.correct_at: float | None = None if correct_at is None else float(correct_at)

    def __call__(self, prompt: Prompt, response: str) -> float:
        value = self.fn(prompt, response, **self.options)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"task.reward={self.spec!r} returned {value!r} for the prompt {prompt.text[:40]!r}; "
                             "a reward must be a finite float")
        return float(value)


@dataclass(frozen=True)
class Task:
    """The built task: where prompts come from, how text becomes tokens, how responses score."""

    source: TaskSource
    tokenizer: Tokenizer
    reward: BoundReward


def _check_call(fn: Callable, args: tuple, kwargs: Mapping[str, Any], what: str, key: str) -> None:
    """Refuse keywords ``fn`` does not take before calling it, naming the config key."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to check (some builtins): the call itself will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"{key}: {what} cannot be called with {sorted(kwargs)} ({err})") from None


def build_source(source: str, options: Mapping[str, Any]) -> TaskSource:
    """The task source ``source`` (``jsonl``, ``datasets`` or an import path) built with ``options``."""
    if source == TASK_JSONL:
        return JsonlTaskSource(**options)
    if source == TASK_DATASETS:
        return DatasetsTaskSource(**options)
    factory = load_object(source, "task.source")
    if not callable(factory):
        raise ValueError(f"task.source={source!r} is not callable")
    _check_call(factory, (), options, f"task.source={source!r}", "task.options")
    return _checked_source(source, factory(**options))


def _checked_source(spec: str, source: Any) -> TaskSource:
    if not isinstance(source, TaskSource):
        raise ValueError(f"task.source={spec!r} returned {type(source).__name__}, "
                         "which has no prompts(step, n, rng) method")
    return source


def _build_tokenizer(cfg: TaskConfig, model_dir: str) -> Tokenizer:
    if cfg.tokenizer == TASK_HF:
        try:
            return HFTokenizer.from_folder(model_dir, cfg.chat_template, cfg.system_prompt)
        except ValueError as err:
            raise ValueError(f"task.tokenizer='hf': {err}") from None
    factory = load_object(cfg.tokenizer, "task.tokenizer")
    if not callable(factory):
        raise ValueError(f"task.tokenizer={cfg.tokenizer!r} is not callable")
    _check_call(factory, (), {}, f"task.tokenizer={cfg.tokenizer!r}", "task.tokenizer")
    tokenizer = factory()
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"task.tokenizer={cfg.tokenizer!r} returned {type(tokenizer).__name__}, which lacks "
                         "the Tokenizer interface (vocab_size, bos_id, eos_id, encode, decode)")
    return tokenizer


def build_task(cfg: TaskConfig, model_dir: str) -> Task:
    """Import and build the configured source, tokenizer and reward.

    ``model_dir`` is the policy's folder (``task.tokenizer: hf`` reads it). Errors
    name the config key at fault (task.source, task.options, task.reward,
    task.reward_options, task.tokenizer); a source's own checks of its options
    raise its own ``ValueError`` (the demo's name ``task.options.<field>``, the
    JSONL source the file, line and key).
    """
    source = build_source(cfg.source, cfg.options)
    fn = load_object(cfg.reward, "task.reward")
    if not callable(fn):
        raise ValueError(f"task.reward={cfg.reward!r} is not callable")
    _check_call(fn, (Prompt(""), ""), cfg.reward_options, f"task.reward={cfg.reward!r}", "task.reward_options")
    return Task(source, _build_tokenizer(cfg, model_dir), BoundReward(fn, cfg.reward, cfg.reward_options))


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int, model_dir: str) -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"task.tokenizer: the tokenizer's vocab_size {tokenizer.vocab_size} exceeds the model's "
                         f"vocab_size {model_vocab_size} ({model_dir})")


def check_eos(tokenizer: Tokenizer, model_eos_id: int, model_dir: str) -> None:
    """The rollout stops rows at the model config's EOS; the tokenizer must mean the same token."""
    if tokenizer.eos_id != model_eos_id:
        raise ValueError(f"task.tokenizer: the tokenizer's eos id {tokenizer.eos_id} differs from the model's "
                         f"eos_token_id {model_eos_id} ({model_dir}/config.json); rollouts would not stop where "
                         "the tokenizer ends a response")
