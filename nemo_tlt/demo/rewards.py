"""Rule-based, verifiable rewards for the synthetic tasks (pure functions).

The reward is outcome-only, as in the RL recipes TLT accelerates:

    reward = 1.0                     if the answer after '#' equals problem.answer
             format_bonus            if the response is well formed but wrong
             0.0                     otherwise

"Well formed" means exactly one '#', followed by a non-empty answer made only of
digits and commas (the answer alphabet of every task). ``format_bonus``
defaults to 0.0, which makes the reward strictly binary; a small positive value
(e.g. 0.1) rewards a model for learning to terminate its trace properly.

The response is the generated text after the prompt, as decoded by
:class:`nemo_tlt.demo.tokenizer.CharTokenizer` (EOS renders as nothing). Trailing
whitespace is ignored; nothing else is forgiven.

:func:`arith_reward` is the same reward behind the framework's ``RewardFn``
interface (``task.reward`` in the config), scoring against ``Prompt.answer``.
"""
from __future__ import annotations

from typing import Sequence

from nemo_tlt.demo.tasks import Problem
from nemo_tlt.rl.data.task import Prompt

_ANSWER_CHARS = frozenset("0123456789,")


def extract_answer(response_text: str) -> str | None:
    """The text after the single '#', or None when the response is malformed."""
    text = response_text.rstrip()
    if text.count("#") != 1:
        return None
    answer = text.split("#", 1)[1]
    if not answer or not set(answer) <= _ANSWER_CHARS:
        return None
    return answer


def _score(expected: str, response_text: str, format_bonus: float, who: str) -> float:
    if not 0.0 <= format_bonus < 1.0:
        raise ValueError(f"{who}: format_bonus must be in [0, 1), got {format_bonus!r}")
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    return 1.0 if answer == expected else float(format_bonus)


def reward(problem: Problem, response_text: str, format_bonus: float = 0.0) -> float:
    """Outcome reward of one response; see the module docstring for the formula."""
    return _score(problem.answer, response_text, format_bonus, "reward")


def arith_reward(prompt: Prompt, response: str, format_bonus: float = 0.0) -> float:
    """:func:`reward` against ``prompt.answer`` (a RewardFn: ``task.reward_options`` give format_bonus)."""
    if prompt.answer is None:
        raise ValueError(f"arith_reward: the prompt {prompt.text[:40]!r} has no answer to check against")
    return _score(prompt.answer, response, format_bonus, "task.reward_options")


arith_reward.correct_at = 1.0  # a correct answer scores 1 (validation reports the share that do)


def batch_rewards(
    problems: Sequence[Problem], responses: Sequence[str], format_bonus: float = 0.0
) -> list[float]:
    """Rewards of ``responses[i]`` against ``problems[i]``."""
    if len(problems) != len(responses):
        raise ValueError(f"batch_rewards: {len(problems)} problems but {len(responses)} responses")
    return [reward(p, r, format_bonus) for p, r in zip(problems, responses)]
