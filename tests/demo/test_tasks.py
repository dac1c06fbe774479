"""Synthetic tasks: heavy tails, correct traces, bounds, reproducibility, validation."""
import re

import numpy as np
import pytest

from nemo_tlt.demo.tasks import (
    TASK_NAMES, Problem, TaskConfig, make_problem, make_problems, sft_text, step_distribution,
    worst_case_prompt_chars, worst_case_solution_chars,
)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_solution_lengths_are_heavy_tailed(name):
    problems = make_problems(TaskConfig(name=name), 1000, np.random.default_rng(1))
    lengths = np.array([len(p.solution) for p in problems])
    assert lengths.max() >= 8 * np.median(lengths)
    # Mostly short: the median problem is far below the cap.
    assert np.median(lengths) <= 0.1 * TaskConfig(name=name).max_solution_chars


@pytest.mark.parametrize("name", TASK_NAMES)
def test_lengths_respect_the_configured_bounds(name):
    config = TaskConfig(name=name, max_solution_chars=200)
    rng = np.random.default_rng(2)
    longest = [make_problem(config, config.max_steps, rng) for _ in range(20)]
    problems = make_problems(config, 300, rng) + longest
    for p in problems:
        assert len(p.solution) <= 200
        assert len(p.solution) <= worst_case_solution_chars(name, p.num_steps, config.max_value)
        assert len(p.prompt) <= worst_case_prompt_chars(name, p.num_steps)
        assert len(sft_text(p)) <= config.max_total_chars
    # Auto max_steps is the largest that fits: one more step would not.
    assert worst_case_solution_chars(name, config.max_steps + 1, config.max_value) > 200


def test_arith_trace_is_a_correct_running_total():
    config = TaskConfig(name="arith", max_value=30)
    for p in make_problems(config, 300, np.random.default_rng(3)):
        ops = re.findall(r"([+-])(\d)", p.prompt)
        assert len(ops) == p.num_steps and p.prompt.endswith("=")
        body, answer = p.solution.split("#")
        total = int(p.prompt[0])
        for step, (op, digit) in zip(body.split(";"), ops):
            new_total = total + int(digit) if op == "+" else total - int(digit)
            assert 0 <= new_total <= 30
            assert step == f"{total}{op}{digit}={new_total}"
            total = new_total
        signed = sum(int(d) if op == "+" else -int(d) for op, d in ops)
        assert answer == p.answer == str(total) == str(int(p.prompt[0]) + signed)


def test_arith_example_format():
    p = make_problem(TaskConfig(name="arith"), 3, np.random.default_rng(0))
    assert re.fullmatch(r"\d([+-]\d){3}=", p.prompt)
    assert re.fullmatch(r"(\d+[+-]\d=\d+;){2}\d+[+-]\d=\d+#\d+", p.solution)


def test_count_trace():
    for p in make_problems(TaskConfig(name="count"), 300, np.random.default_rng(4)):
        target, text = re.fullmatch(r"([a-z]):([a-z]+)=", p.prompt).groups()
        body, answer = p.solution.split("#")
        steps = body.split(";")
        assert "".join(s[0] for s in steps) == text
        assert [int(s[1:]) for s in steps] == [text[: i + 1].count(target) for i in range(len(text))]
        assert answer == p.answer == str(text.count(target))


def test_sort_trace_is_insertion_sort():
    for p in make_problems(TaskConfig(name="sort"), 300, np.random.default_rng(5)):
        values = [int(v) for v in re.fullmatch(r"sort:([\d,]+)=", p.prompt).group(1).split(",")]
        body, answer = p.solution.split("#")
        for k, step in enumerate(body.split(";"), start=1):
            assert step == ",".join(map(str, sorted(values[:k])))
        assert answer == p.answer == ",".join(map(str, sorted(values)))


def test_reproducible_from_the_generator():
    config = TaskConfig(name="arith")
    a = make_problems(config, 50, np.random.default_rng(7))
    b = make_problems(config, 50, np.random.default_rng(7))
    c = make_problems(config, 50, np.random.default_rng(8))
    assert a == b and a != c
    assert all(isinstance(p, Problem) for p in a)


def test_step_distribution_is_truncated_zeta():
    config = TaskConfig(name="count", min_steps=2, max_steps=40, tail_exponent=2.0)
    ks, probs = step_distribution(config)
    assert ks[0] == 2 and ks[-1] == 40 and probs.sum() == pytest.approx(1.0)
    assert probs[0] / probs[1] == pytest.approx((3 / 2) ** 2)
    steps = [p.num_steps for p in make_problems(config, 4000, np.random.default_rng(9))]
    assert min(steps) >= 2 and max(steps) <= 40
    # Empirical mass at the minimum within 5 sigma of the law.
    sigma = np.sqrt(probs[0] * (1 - probs[0]) / 4000)
    assert abs(np.mean(np.array(steps) == 2) - probs[0]) < 5 * sigma


@pytest.mark.parametrize("kwargs, field", [
    ({"name": "nope"}, "name"),
    ({"min_steps": 0}, "min_steps"),
    ({"tail_exponent": 0.0}, "tail_exponent"),
    ({"max_value": 5}, "max_value"),
    ({"max_solution_chars": 0}, "max_solution_chars"),
    ({"name": "sort", "max_steps": 48}, "max_steps"),
    ({"min_steps": 5, "max_steps": 3}, "max_steps"),
    ({"name": "sort", "max_solution_chars": 3, "min_steps": 2}, "max_solution_chars"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"TaskConfig.{field}"):
        TaskConfig(**kwargs)


def test_make_problem_rejects_out_of_range_steps():
    config = TaskConfig(name="arith", max_steps=10)
    with pytest.raises(ValueError, match="num_steps"):
        make_problem(config, 11, np.random.default_rng(0))
