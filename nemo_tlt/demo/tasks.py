"""Verifiable step-by-step tasks whose solution lengths are heavy-tailed.

TLT exists because RL rollouts are long-tailed: most responses end early and a
few run 10-30x longer. These tasks reproduce that on CPU. The number of steps of
a problem is drawn from a truncated zeta law, P(k) ∝ k^-s on [min_steps,
max_steps], so the median problem is short and a few are very long; the solution
trace grows with the number of steps (linearly for ``arith`` and ``count``,
quadratically for ``sort``).

Traces are deliberately regular: each step mostly copies text from the prompt
or from the previous step and computes one small thing. A tiny LM learns them on
a CPU, and a drafter can predict most of their tokens,
which is what speculative decoding needs to pay off.

Tasks (prompt -> solution; the answer follows the single '#'):
- ``arith``: running totals of one-digit additions and subtractions, the total
  kept in [0, max_value]: ``"3+5-2+7="`` -> ``"3+5=8;8-2=6;6+7=13#13"``.
- ``count``: count one letter in a string, one step per character, printing the
  character and the running count: ``"a:baac="`` -> ``"b0;a1;a2;c2#2"``.
- ``sort``: insertion sort of one-digit numbers, printing the sorted prefix after
  each insertion: ``"sort:3,1,2="`` -> ``"3;1,3;1,2,3#1,2,3"``.

Every generator takes a ``numpy.random.Generator``; nothing reads the global RNG.
Every character used is in :data:`nemo_tlt.demo.tokenizer.ALPHABET`.

:class:`ArithTaskSource` serves these problems to the RL loop through the
framework's ``TaskSource`` interface (``task.source`` in the config).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.rl.data.task import Prompt

TASK_NAMES = ("arith", "count", "sort")
_COUNT_LETTERS = "abcde"


@dataclass(frozen=True)
class Problem:
    """One verifiable problem: ``prompt + solution`` is the reference text."""

    task: str
    prompt: str
    solution: str
    answer: str
    num_steps: int


@dataclass(frozen=True)
class TaskConfig:
    """Which task, and the heavy-tailed law of its number of steps.

    ``max_steps=0`` means "the largest step count whose worst-case solution fits
    in ``max_solution_chars``" and is resolved at construction.
    """

    name: str = "arith"
    min_steps: int = 1
    max_steps: int = 0
    tail_exponent: float = 1.5
    max_solution_chars: int = 400
    max_value: int = 99  # arith only: running totals stay in [0, max_value]

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ValueError(f"TaskConfig.name must be one of {list(TASK_NAMES)}, got {self.name!r}")
        if not isinstance(self.min_steps, int) or self.min_steps < 1:
            raise ValueError(f"TaskConfig.min_steps must be a positive int, got {self.min_steps!r}")
        if not isinstance(self.max_value, int) or not 9 <= self.max_value <= 999:
            raise ValueError(f"TaskConfig.max_value must be an int in [9, 999], got {self.max_value!r}")
        if not self.tail_exponent > 0:
            raise ValueError(f"TaskConfig.tail_exponent must be > 0, got {self.tail_exponent!r}")
        if not isinstance(self.max_solution_chars, int) or self.max_solution_chars < 1:
            raise ValueError(
                f"TaskConfig.max_solution_chars must be a positive int, got {self.max_solution_chars!r}"
            )
        largest = _largest_fitting_steps(self.name, self.max_solution_chars, self.max_value)
        if largest < self.min_steps:
            raise ValueError(
                f"TaskConfig.max_solution_chars={self.max_solution_chars} cannot hold even min_steps="
                f"{self.min_steps} steps of task {self.name!r}"
            )
        if self.max_steps == 0:
            object.__setattr__(self, "max_steps", largest)
        if not isinstance(self.max_steps, int) or self.max_steps < self.min_steps:
            raise ValueError(
                f"TaskConfig.max_steps must be an int >= min_steps={self.min_steps} (or 0 for auto), "
                f"got {self.max_steps!r}"
            )
        if self.max_steps > largest:
            raise ValueError(
                f"TaskConfig.max_steps={self.max_steps} gives {self.name!r} solutions of up to "
                f"{worst_case_solution_chars(self.name, self.max_steps, self.max_value)} chars, above "
                f"max_solution_chars={self.max_solution_chars}; use max_steps <= {largest} (or 0 for auto)"
            )

    @property
    def max_prompt_chars(self) -> int:
        return worst_case_prompt_chars(self.name, self.max_steps)

    @property
    def max_total_chars(self) -> int:
        """Longest ``prompt + solution`` this config can produce (add BOS/EOS for tokens)."""
        return self.max_prompt_chars + worst_case_solution_chars(self.name, self.max_steps, self.max_value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- worst-case lengths (used to validate configs against a context size) ----

def worst_case_solution_chars(task: str, num_steps: int, max_value: int = 99) -> int:
    """Upper bound on ``len(solution)`` for ``num_steps`` steps of ``task``."""
    if task == "arith":
        # "<total><op><digit>=<total>" + ";" or "#", then the answer.
        width = len(str(max_value))
        return num_steps * (2 * width + 4) + width
    if task == "count":
        # "<letter><count>" + ";" or "#", then the answer; counts never exceed num_steps.
        width = len(str(num_steps))
        return num_steps * (width + 2) + width
    if task == "sort":
        # Step k prints k digits and k-1 commas, then ";" or "#"; the answer has 2n-1 chars.
        return num_steps * (num_steps + 1) + 2 * num_steps - 1
    raise ValueError(f"unknown task {task!r}; known: {list(TASK_NAMES)}")


def worst_case_prompt_chars(task: str, num_steps: int) -> int:
    if task == "arith":
        return 2 * num_steps + 2  # first digit, then "<op><digit>" per step, then "="
    if task == "count":
        return num_steps + 3  # "<letter>:" + string + "="
    if task == "sort":
        return len("sort:") + 2 * num_steps  # digits, commas, final "="
    raise ValueError(f"unknown task {task!r}; known: {list(TASK_NAMES)}")


def _largest_fitting_steps(task: str, max_chars: int, max_value: int) -> int:
    steps = 0
    while worst_case_solution_chars(task, steps + 1, max_value) <= max_chars:
        steps += 1
    return steps


# ---- the heavy-tailed law of the number of steps ----------------------------

def step_distribution(config: TaskConfig) -> tuple[np.ndarray, np.ndarray]:
    """Support and probabilities of the truncated zeta law P(k) ∝ k^-s."""
    ks = np.arange(config.min_steps, config.max_steps + 1)
    weights = ks.astype(np.float64) ** (-config.tail_exponent)
    return ks, weights / weights.sum()


def sample_num_steps(config: TaskConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    ks, probs = step_distribution(config)
    return rng.choice(ks, size=n, p=probs)


# ---- generators: (num_steps, rng, config) -> Problem ------------------------

def _make_arith(num_steps: int, rng: np.random.Generator, config: TaskConfig) -> Problem:
    total = int(rng.integers(1, 10))
    prompt, steps = [str(total)], []
    for _ in range(num_steps):
        # Pick an operation that keeps the total inside [0, max_value], then a
        # digit allowed for it; with max_value >= 9 at least one is always open.
        ops = [op for op, ok in (("+", total + 1 <= config.max_value), ("-", total - 1 >= 0)) if ok]
        op = ops[int(rng.integers(len(ops)))]
        limit = config.max_value - total if op == "+" else total
        digit = int(rng.integers(1, min(9, limit) + 1))
        new_total = total + digit if op == "+" else total - digit
        prompt.append(f"{op}{digit}")
        steps.append(f"{total}{op}{digit}={new_total}")
        total = new_total
    answer = str(total)
    return Problem("arith", "".join(prompt) + "=", ";".join(steps) + "#" + answer, answer, num_steps)


def _make_count(num_steps: int, rng: np.random.Generator, config: TaskConfig) -> Problem:
    del config
    target = _COUNT_LETTERS[int(rng.integers(len(_COUNT_LETTERS)))]
    text = "".join(_COUNT_LETTERS[int(i)] for i in rng.integers(len(_COUNT_LETTERS), size=num_steps))
    count, steps = 0, []
    for ch in text:
        count += ch == target
        steps.append(f"{ch}{count}")
    answer = str(count)
    return Problem("count", f"{target}:{text}=", ";".join(steps) + "#" + answer, answer, num_steps)


def _make_sort(num_steps: int, rng: np.random.Generator, config: TaskConfig) -> Problem:
    del config
    values = [int(v) for v in rng.integers(0, 10, size=num_steps)]
    prefix: list[int] = []
    steps = []
    for v in values:
        # Insert after equal values, so the trace is the stable insertion sort.
        pos = sum(1 for p in prefix if p <= v)
        prefix.insert(pos, v)
        steps.append(",".join(map(str, prefix)))
    answer = steps[-1]
    prompt = "sort:" + ",".join(map(str, values)) + "="
    return Problem("sort", prompt, ";".join(steps) + "#" + answer, answer, num_steps)


_GENERATORS: dict[str, Callable[[int, np.random.Generator, TaskConfig], Problem]] = {
    "arith": _make_arith,
    "count": _make_count,
    "sort": _make_sort,
}


def make_problem(config: TaskConfig, num_steps: int, rng: np.random.Generator) -> Problem:
    """One problem with exactly ``num_steps`` steps (e.g. to build a worst-case batch)."""
    if not config.min_steps <= num_steps <= config.max_steps:
        raise ValueError(
            f"num_steps={num_steps} is outside TaskConfig [min_steps={config.min_steps}, "
            f"max_steps={config.max_steps}]"
        )
    problem = _GENERATORS[config.name](int(num_steps), rng, config)
    # The worst-case bound is what configs are validated against; a longer trace is a bug here.
    if len(problem.solution) > config.max_solution_chars:
        raise AssertionError(f"{config.name} solution of {len(problem.solution)} chars exceeds the bound")
    return problem


def make_problems(config: TaskConfig, n: int, rng: np.random.Generator) -> list[Problem]:
    """``n`` problems with heavy-tailed step counts, reproducible from ``rng``."""
    if n < 0:
        raise ValueError(f"make_problems: n must be >= 0, got {n}")
    return [make_problem(config, int(k), rng) for k in sample_num_steps(config, n, rng)]


def sft_text(problem: Problem) -> str:
    """The reference text a warm-start model is trained on: prompt then solution."""
    return problem.prompt + problem.solution


# ---- the framework's TaskSource over these problems --------------------------

# The task the demo's shipped models were trained on (AssetConfig.task): an RL run
# with no task.options draws its prompts from it.
DEMO_TASK_OPTIONS: dict[str, Any] = {
    "name": "arith", "min_steps": 1, "max_steps": 0, "tail_exponent": 1.3, "max_solution_chars": 400,
    "max_value": 99,
}


class ArithTaskSource:
    """``TaskSource`` over the synthetic tasks; ``options`` are :class:`TaskConfig`'s
    fields (defaults :data:`DEMO_TASK_OPTIONS`), errors naming ``task.options.<field>``.

    The prompts of a step are exactly ``make_problems(self.config, n, rng)``, as
    ``Prompt(problem.prompt, problem.answer, meta={task, solution, num_steps})``.
    """

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(DEMO_TASK_OPTIONS))
        if unknown:
            raise ValueError(f"task.options has keys {unknown} that ArithTaskSource does not take; "
                             f"known: {list(DEMO_TASK_OPTIONS)}")
        merged = {**DEMO_TASK_OPTIONS, **options}
        if merged["name"] not in TASK_NAMES:
            raise ValueError(f"task.options.name must be one of {list(TASK_NAMES)}, got {merged['name']!r}")
        for key in ("min_steps", "max_steps", "max_solution_chars", "max_value"):
            check_int(f"task.options.{key}", merged[key])
        check_float("task.options.tail_exponent", merged["tail_exponent"])
        try:
            self.config = TaskConfig(**merged)
        except ValueError as err:
            # TaskConfig names its own fields; users wrote them under task.options.
            raise ValueError(str(err).replace("TaskConfig.", "task.options.")) from None

    def prompts(self, step: int, n: int, rng: np.random.Generator) -> list[Prompt]:
        del step  # the loop seeds rng from (seed, step); the draw depends on rng alone
        return [Prompt(p.prompt, str(p.answer), {"task": p.task, "solution": p.solution, "num_steps": p.num_steps})
                for p in make_problems(self.config, n, rng)]
