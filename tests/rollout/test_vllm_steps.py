"""`vllm_steps.run_steps` against a scripted engine with vLLM's stepping semantics: a step
verifies the drafts the previous step's draft length proposed. What the policy is asked and
told, what the trace names, and when results are handed over."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_tlt.rollout.protocol import RequestResult
from nemo_tlt.rollout.vllm_steps import StepControl, run_steps
from nemo_tlt.speculative.tree_shape import TreeShape

CHAIN3 = TreeShape(3, 1, 3)


class ScriptedEngine:
    """Rows of fixed lengths; every draft token is accepted, so a row verifying k drafts
    makes k + 1 tokens. The first step prefills (one token per row)."""

    def __init__(self, lengths: list[int]) -> None:
        self.left = dict(enumerate(lengths))
        self.k = 0
        self.drafted = 0  # draft length proposed at the end of the last step
        self.started = False

    def set_draft_len(self, k: int) -> None:
        self.k = k

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list:
        per_row = 1 if not self.started else self.drafted + 1
        self.started, self.drafted = True, self.k
        outs = []
        for i, left in list(self.left.items()):
            n = min(per_row, left)
            self.left[i] = left - n
            done = self.left[i] == 0
            if done:
                del self.left[i]
            outs.append(SimpleNamespace(request_id=f"r{i}", finished=done, outputs=[SimpleNamespace(
                token_ids=[7] * n, logprobs=[{7: -0.1}] * n, finish_reason="length" if done else None)]))
        return outs


class ScriptedPolicy:
    def __init__(self, choices: list[TreeShape | None]) -> None:
        self.choices, self.asked, self.told = list(choices), [], []

    def choose(self, running: int) -> TreeShape | None:
        self.asked.append(running)
        return self.choices.pop(0) if self.choices else None

    def observe(self, running, shape, tokens, elapsed) -> None:
        self.told.append((running, shape, tokens))


def run(lengths, choices, drafter_loaded=True):
    engine, policy, finished = ScriptedEngine(lengths), ScriptedPolicy(choices), []

    def finish(i, tokens, reason, logprobs, completion):
        return RequestResult(list(tokens), reason, logprobs=[-0.1] * len(tokens))

    control = StepControl(policy, 4, drafter_loaded, engine.set_draft_len, max_running=8)
    stats = run_steps(engine, [f"r{i}" for i in range(len(lengths))], control, finish,
                      lambda i, r: finished.append((i, len(r.tokens))))
    return stats, policy, finished


def test_only_steady_steps_are_observed_and_a_new_length_is_held_one_step():
    # choices: plain (at the prefill), plain, chain 3 (a switch: held for the next step
    # without asking), chain 3, then plain (a switch); 12 tokens per row
    stats, policy, _ = run([12, 12], [None, None, CHAIN3, CHAIN3, None])
    assert [s.shape for s in stats.trace] == [None, None, "3_1_3", "3_1_3", "3_1_3"]
    # steps 3 (plain verified, chain drafted) and 6 (chain verified, nothing drafted) mix two choices
    assert policy.told == [(2, None, 2), (2, CHAIN3, 8), (2, CHAIN3, 8)]
    assert len(policy.asked) == 5  # step 4 ran the held chain without asking
    assert (stats.prefill_forwards, stats.plain_steps, stats.sd_steps, stats.tokens_generated) == (1, 2, 3, 24)


def test_a_probe_after_plain_steps_is_measured():
    """A policy that tries a chain once between plain steps still sees it measured: the
    chain is held the step after the switch, which verifies and drafts that length."""
    stats, policy, _ = run([20, 20], [None, None, CHAIN3, None, None, None])
    assert (2, CHAIN3, 8) in policy.told


def test_results_arrive_the_step_they_finish_and_running_counts_fall():
    stats, policy, finished = run([2, 5, 3], [])
    assert finished == [(0, 2), (2, 3), (1, 5)]
    assert policy.asked[:3] == [3, 3, 2] and [s.running for s in stats.trace] == [3, 2, 1, 1]


def test_a_chain_without_a_drafter_is_refused():
    with pytest.raises(ValueError, match="no drafter is loaded"):
        run([4], [CHAIN3], drafter_loaded=False)
