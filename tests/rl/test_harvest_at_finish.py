"""The rollout's drafter features leave the engine as each row finishes (``InOrderHarvest``):
each finished row's features become the harvest buffer's compact host copy at once and the
engine's are dropped; the copies reach the buffer in request order, each as soon as every
earlier row is in; rows an engine did not hand over are taken from the results at the end.
The buffer receives the same samples, bit for bit, as when they were taken after the rollout."""
from __future__ import annotations

from functools import partial

import torch

from nemo_tlt.rl.harvest_rows import InOrderHarvest
from nemo_tlt.rollout.protocol import Request, RequestResult
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from tiny import tiny_target


def _sample(buffer, tokens, hidden):
    return buffer.make_sample(torch.tensor(tokens), hidden, 0)


def test_rows_go_in_request_order_as_soon_as_every_earlier_row_is_in():
    reqs = [Request([1, 2]), Request([3]), Request([4, 5]), Request([6])]
    added = []
    harvest = InOrderHarvest(reqs, lambda tokens, hidden: tokens, added.append)
    results = [RequestResult([7, 8], "length", hidden_states=torch.zeros(1)) for _ in reqs]
    harvest.take(2, results[2])
    assert added == [] and results[2].hidden_states is None  # the engine's copy dropped at once
    harvest.take(0, results[0])
    assert added == [[1, 2, 7, 8]]  # row 1 is not in yet: row 2 waits
    harvest.take(1, results[1])
    assert added == [[1, 2, 7, 8], [3, 7, 8], [4, 5, 7, 8]]
    harvest.take(1, results[1])  # handed over twice: taken once
    harvest.finish(results)  # row 3 never came through on_finish
    assert added[-1] == [6, 7, 8] and len(added) == 4


def test_rows_this_rank_does_not_keep_are_dropped_as_they_finish():
    """``keep``: a tensor-parallel member's share; the other rows' features are freed at once and
    never copied, and the kept ones still go in request order."""
    reqs = [Request([i]) for i in range(5)]
    added, made = [], []
    harvest = InOrderHarvest(reqs, lambda tokens, hidden: made.append(tokens) or tokens, added.append,
                             keep=lambda i: i % 2 == 1)
    results = [RequestResult([9], "length", hidden_states=torch.zeros(1)) for _ in reqs]
    for i in (4, 3, 0, 2):
        harvest.take(i, results[i])
        assert results[i].hidden_states is None
    assert added == [] and made == [[3, 9]]  # row 1 is not in yet
    harvest.finish(results)
    assert added == [[1, 9], [3, 9]] and made == [[3, 9], [1, 9]]


def test_the_buffer_gets_the_samples_it_got_after_the_rollout():
    target = tiny_target()
    engine = TorchRolloutEngine(target)
    reqs = [Request([3, 4, 5], seq_id=0), Request([6], seq_id=1), Request([7, 8], seq_id=2)]
    sampling = SamplingParams(max_new_tokens=12)
    config = HarvestConfig(target.config.hidden_size, min_length=2)
    after, now = HarvestBuffer(config), HarvestBuffer(config)
    out = engine.generate(reqs, sampling, return_hidden=True)
    for req, res in zip(reqs, out.results):  # the rollout's rows, taken after it
        after.add_sample(_sample(after, list(req.prompt) + res.tokens, res.hidden_states))
    order = []
    harvest = InOrderHarvest(reqs, partial(_sample, now), now.add_sample)
    engine.generate(reqs, sampling, return_hidden=True,
                    on_finish=lambda i, r: (order.append(i), harvest.take(i, r)))
    assert sorted(order) == [0, 1, 2] and len(now) == len(after) == 3
    for a, b in zip(now._samples, after._samples):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.hidden, b.hidden) and a.step == b.step
