"""The demo behind the framework's interfaces: ArithTaskSource and arith_reward.

The pinned digests were computed with the loop's former ``step_problems``
(``make_problems(TaskBlock().to_task_config(), n, default_rng([seed, step, 0x71]))``)
before the demo moved behind ``TaskSource``: the main job's prompts, and so its
rewards, must stay bit-identical.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from nemo_tlt.demo.rewards import arith_reward, reward
from nemo_tlt.demo.tasks import DEMO_TASK_OPTIONS, ArithTaskSource, TaskConfig, make_problems
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.rl.data.task import Prompt, TaskSource, Tokenizer

# (seed, step, task.options, digest of [[prompt, answer], ...] for n=8, first prompt, first answer)
PINNED = [
    (0, 0, {}, "afdd279718dd8ec8", "6-2+6+1-1-6+8-3+1=", "10"),
    (0, 1, {}, "40b342409fdd62be", "8+2-8-2+6+2+3+5-7+5-3+7+5+1+3-2+6+4-9+3-7=", "22"),
    (0, 2, {}, "bed90128c90c7529", "7+2+4-8=", "5"),
    (0, 3, {}, "c781f1d72d22453a", "6-5=", "1"),
    (5, 2, {"name": "count"}, "0b635912bb9ab86a", "b:aa=", "0"),
    (7, 1, {"name": "sort", "max_solution_chars": 200}, "b9b45d6e0159db28", "sort:0,8,7=", "0,7,8"),
    (11, 4, {"max_value": 500, "min_steps": 3, "tail_exponent": 0.8}, "02baed031ffe129e",
     "7+6+5+4-3-3-8-1+8-4+4+2-3-4-9=", "1"),
]


def digest(prompts: list[Prompt]) -> str:
    return hashlib.sha256(json.dumps([[p.text, p.answer] for p in prompts]).encode()).hexdigest()[:16]


@pytest.mark.parametrize("seed, step, options, expected, first_prompt, first_answer", PINNED)
def test_prompts_are_those_of_the_former_step_problems(seed, step, options, expected, first_prompt, first_answer):
    source = ArithTaskSource(**options)
    prompts = source.prompts(step, 8, np.random.default_rng([seed, step, 0x71]))
    assert (prompts[0].text, prompts[0].answer) == (first_prompt, first_answer)
    assert digest(prompts) == expected
    problems = make_problems(source.config, 8, np.random.default_rng([seed, step, 0x71]))
    assert prompts == [Prompt(p.prompt, p.answer, {"task": p.task, "solution": p.solution, "num_steps": p.num_steps})
                       for p in problems]


def test_defaults_are_the_task_the_demo_models_were_trained_on():
    from nemo_tlt.demo.assets import AssetConfig

    source = ArithTaskSource()
    assert isinstance(source, TaskSource) and isinstance(CharTokenizer(), Tokenizer)
    assert source.config == AssetConfig().task == TaskConfig(**DEMO_TASK_OPTIONS)


@pytest.mark.parametrize("options, message", [
    ({"nme": "arith"}, r"task.options has keys \['nme'\]"),
    ({"name": "algebra"}, "task.options.name must be one of"),
    ({"tail_exponent": "1.3"}, "task.options.tail_exponent must be a number"),
    ({"min_steps": True}, "task.options.min_steps must be an int"),
    ({"max_value": 5}, r"task.options.max_value must be an int in \[9, 999\]"),
    ({"max_steps": 500}, "task.options.max_steps=500 gives 'arith' solutions"),
])
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        ArithTaskSource(**options)


def test_arith_reward_is_the_former_reward():
    problems = [p for name in ("arith", "count", "sort")
                for p in make_problems(TaskConfig(name=name, max_solution_chars=60), 20, np.random.default_rng(3))]
    source_prompts = [Prompt(p.prompt, p.answer) for p in problems]
    for i, (problem, prompt) in enumerate(zip(problems, source_prompts)):
        other = problems[(i + 1) % len(problems)]
        responses = [problem.solution, problem.solution + " \n", other.solution, "no answer", "#", "1#2#3",
                     "x#" + problem.answer, "#" + problem.answer + "a", ""]
        for response in responses:
            for bonus in (0.0, 0.1, 0.5):
                assert arith_reward(prompt, response, format_bonus=bonus) == reward(problem, response, bonus)
    assert arith_reward(source_prompts[0], problems[0].solution) == 1.0


def test_arith_reward_refuses_a_bad_bonus_and_a_prompt_without_answer():
    with pytest.raises(ValueError, match="task.reward_options: format_bonus must be in"):
        arith_reward(Prompt("1+1=", "2"), "#2", format_bonus=1.0)
    with pytest.raises(ValueError, match="has no answer"):
        arith_reward(Prompt("1+1="), "#2")
