"""The rollout's drafter features leave the engine as each row finishes: the loop's sink takes a
finished row's features into the drafter buffer's compact host copy at once and drops the
engine's, and the buffer still receives the rows in request order, as it did when they were
taken after the rollout (the same samples, bit for bit)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_tlt.rl.idle_drafter import IdleDrafter
from nemo_tlt.rl.loop import RLWorker
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from tiny import tiny_target


class _Drafter:
    """IdleDrafter's harvest / sample over a real buffer (the rest of it is not needed here)."""

    def __init__(self, width: int) -> None:
        self.buffer = HarvestBuffer(HarvestConfig(width, min_length=2))

    min_length = IdleDrafter.min_length
    sample = IdleDrafter.sample
    harvest = IdleDrafter.harvest


def test_features_are_taken_as_rows_finish_and_added_in_request_order():
    target = tiny_target()
    engine = TorchRolloutEngine(target)
    reqs = [Request([3, 4, 5], seq_id=0), Request([6], seq_id=1), Request([7, 8], seq_id=2)]
    sampling = SamplingParams(max_new_tokens=12, stop_on_eos=False)
    reqs_by_len = [Request(r.prompt, seq_id=r.seq_id) for r in reqs]
    width = target.config.hidden_size

    # after the rollout, in request order (what the loop did before)
    after = _Drafter(width)
    out = engine.generate(reqs_by_len, sampling, return_hidden=True)
    for req, res in zip(reqs_by_len, out.results):
        after.harvest(0, list(req.prompt) + res.tokens, res.hidden_states)

    # as each row finishes (rows of different lengths finish at different steps)
    now = _Drafter(width)
    samples, seen = {}, []
    sink = RLWorker._harvesting(SimpleNamespace(drafter=now), 0, reqs_by_len, samples,
                                lambda i, r: seen.append((i, r.hidden_states)))
    engine.generate(reqs_by_len, sampling, return_hidden=True, on_finish=sink)
    assert sorted(i for i, _ in seen) == [0, 1, 2] and all(h is None for _, h in seen)  # dropped at finish
    assert all(not s.hidden.is_cuda and s.hidden.dtype == now.buffer.config.storage_dtype for s in samples.values())
    for index in sorted(samples):
        now.buffer.add_sample(samples[index])
    assert len(now.buffer) == len(after.buffer) == 3
    for a, b in zip(now.buffer._samples, after.buffer._samples):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.hidden, b.hidden) and a.step == b.step
