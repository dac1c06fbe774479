"""Rule-based rewards: exact answer after a single '#', optional format bonus."""
import numpy as np
import pytest

from nemo_tlt.demo.rewards import batch_rewards, extract_answer, reward
from nemo_tlt.demo.tasks import TASK_NAMES, Problem, TaskConfig, make_problems

P = Problem("arith", "3+5-2+7=", "3+5=8;8-2=6;6+7=13#13", "13", 3)


def test_correct_answer_gets_one():
    assert reward(P, P.solution) == 1.0
    assert reward(P, "garbage trace#13") == 1.0  # outcome-only: the trace is not graded
    assert reward(P, "3+5=8#13\n ") == 1.0  # trailing whitespace is forgiven


@pytest.mark.parametrize("response", ["3+5=8;8-2=6;6+7=12#12", "13", "#", "#13#13", "3+5=8#131", "x#13a", ""])
def test_wrong_or_malformed_gets_zero(response):
    assert reward(P, response) == 0.0


def test_format_bonus_only_for_well_formed_wrong_answers():
    assert reward(P, "1+1=2#2", format_bonus=0.1) == pytest.approx(0.1)
    assert reward(P, "1+1=2", format_bonus=0.1) == 0.0
    assert reward(P, P.solution, format_bonus=0.1) == 1.0
    with pytest.raises(ValueError, match="format_bonus"):
        reward(P, P.solution, format_bonus=1.0)


def test_extract_answer():
    assert extract_answer("a#1,2,3") == "1,2,3"
    assert extract_answer("no hash") is None
    assert extract_answer("a#") is None


def test_reference_solutions_of_every_task_score_one():
    rng = np.random.default_rng(0)
    for name in TASK_NAMES:
        problems = make_problems(TaskConfig(name=name), 100, rng)
        assert batch_rewards(problems, [p.solution for p in problems]) == [1.0] * 100
        # Another problem's solution scores exactly when the two answers coincide.
        others = problems[1:] + problems[:1]
        shifted = batch_rewards(problems, [p.solution for p in others])
        assert shifted == [float(p.answer == q.answer) for p, q in zip(problems, others)]
        assert sum(shifted) < 100
    with pytest.raises(ValueError, match="responses"):
        batch_rewards(problems, [])
