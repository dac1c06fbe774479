"""Prompts and the order a source reads its rows in: the pieces every task source shares
(`nemo_tlt.rl.data.task` builds the sources; `nemo_tlt.rl.data.data_sources` reads files with HF
``datasets``). See `nemo_tlt.rl.data.task` for the source contract and the orders."""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from nemo_tlt.config import TASK_ORDERS


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, the reference answer if the task has one, and
    whatever else the reward needs (``meta``, read-only)."""

    text: str
    answer: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ValueError(f"Prompt.text must be a str, got {type(self.text).__name__}")
        if self.answer is not None and not isinstance(self.answer, str):
            raise ValueError(f"Prompt.answer must be a str or None, got {type(self.answer).__name__}")
        # A private copy behind a read-only view: neither the caller nor a reward can change it.
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    def __reduce__(self):
        # mappingproxy does not pickle; prompts cross process boundaries with their meta as a dict.
        return (Prompt, (self.text, self.answer, dict(self.meta)))


@runtime_checkable
class TaskSource(Protocol):
    """The prompts of each RL step (see the module docstring for the determinism contract)."""

    def prompts(self, step: int, n: int, rng: np.random.Generator) -> list[Prompt]: ...


# ---- built in: the order of a source's rows -----------------------------------

ORDERS = TASK_ORDERS


def epoch_rows(num_rows: int, step: int, n: int, shuffle_seed: int) -> list[int]:
    """Row indices of step ``step`` of ``n`` prompts, reading epochs without replacement:
    positions ``[step*n, (step+1)*n)`` of the concatenated per-epoch permutations, epoch
    ``e`` being ``permutation(num_rows)`` under the generator of (shuffle_seed, e)."""
    out, perms = [], {}
    for pos in range(step * n, (step + 1) * n):
        epoch, i = divmod(pos, num_rows)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([shuffle_seed, epoch, 0xE9]).permutation(num_rows)
        out.append(int(perms[epoch][i]))
    return out


def draw_rows(num_rows: int, step: int, n: int, rng: np.random.Generator, order: str,
              shuffle_seed: int, who: str) -> list[int]:
    """The rows of one step by ``order`` (see the module docstring)."""
    if n < 0:
        raise ValueError(f"{who}.prompts: n must be >= 0, got {n}")
    if order == "epochs":
        return epoch_rows(num_rows, step, n, shuffle_seed)
    return [int(i) for i in rng.choice(num_rows, size=n, replace=n > num_rows)]


def check_order(order: str, shuffle_seed: int, who: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"{who}: task.options.order must be one of {list(ORDERS)}, got {order!r}")
    if isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int) or not 0 <= shuffle_seed < 2**63:
        raise ValueError(f"{who}: task.options.shuffle_seed must be an int >= 0, got {shuffle_seed!r}")


# ---- built in: prompts from a JSONL file ------------------------------------

def prompt_from_record(record: dict, prompt_key: str, answer_key: str, where: str, field: str,
                       scalar: str) -> Prompt:
    """One prompt from a row of a prompts file: the text under ``prompt_key``, the answer
    under ``answer_key`` (a scalar or null), every other entry as ``meta``; errors name
    ``where`` and the ``field`` (a JSON "key", a table "column")."""
    text = record[prompt_key]
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: {field} {prompt_key!r} must be a non-empty string, got {text!r}")
    try:
        answer = answer_text(record.get(answer_key))
    except TypeError:
        raise ValueError(f"{where}: {field} {answer_key!r} must be {scalar} or null, "
                         f"got {record[answer_key]!r}") from None
    return Prompt(text, answer, {k: v for k, v in record.items() if k not in (prompt_key, answer_key)})


def answer_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, numbers.Real)):
        return json.dumps(value)  # its JSON text: 3 -> "3", true -> "true"
    raise TypeError
