"""Nothing the engine, the drafters or the spot trainer make lives off the configured device.

A CPU stand-in for a GPU run: models are built on the CPU, then everything runs with
torch's default device set to ``meta`` under a dispatch mode that fails on any op whose
output lands on ``meta``. A tensor made without ``device=`` (which on a GPU would land
on the host and fail, or silently cost a copy) lands there and fails here, naming the op.
Host syncs per decode step are counted the same way, at the dispatcher (`HostReads`), not
by the engine's own counter.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.rollout import torch_engine
from nemo_tlt.rollout.protocol import Request, StepTrace
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig
from nemo_tlt.spot.losses import eagle_loss_fn
from nemo_tlt.spot.trainer import DrafterOptimConfig, SpotTrainer, SpotTrainerConfig
from spot._toys import open_coordinator
from tiny import tiny_target


class NoMetaOutputs(TorchDispatchMode):
    """Fails on the first op that produces a tensor on the meta device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                raise AssertionError(f"{func} made a tensor without the configured device")
        return out


class off_device:
    """Default device ``meta`` plus `NoMetaOutputs`, for the duration of a block."""

    def __enter__(self):
        self._device = torch.device("meta")
        self._device.__enter__()
        self._mode = NoMetaOutputs()
        self._mode.__enter__()

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._device.__exit__(*exc)


def _drafters(cfg):
    eagle = EagleDrafter(EagleConfig.from_target(cfg), generator=torch.Generator().manual_seed(1))
    draft_vocab = 3 * cfg.vocab_size // 4
    eagle3 = Eagle3Drafter(Eagle3Config.from_target(cfg, draft_vocab_size=draft_vocab),
                           generator=torch.Generator().manual_seed(1))
    eagle3.set_draft_vocab(torch.arange(cfg.vocab_size - draft_vocab, cfg.vocab_size))
    return {"eagle2": eagle, "eagle3": eagle3}


def _requests() -> list[Request]:
    return [Request(tuple(range(3, 3 + n)), seq_id=i) for i, n in enumerate((4, 7, 5))]


def test_the_guard_catches_a_tensor_made_without_a_device():
    with pytest.raises(AssertionError, match="without the configured device"):
        with off_device():
            torch.arange(3) + 1


def test_plain_and_speculative_generation_make_nothing_off_device():
    target = tiny_target(seed=0)
    drafters = _drafters(target.config)
    policy = FixedSDPolicy(TreeShape(3, 2, 4))
    with off_device():
        TorchRolloutEngine(target).generate(_requests(), SamplingParams("greedy", max_new_tokens=12))
        for drafter in drafters.values():
            engine = TorchRolloutEngine(target, drafter)
            for mode in ("greedy", "rejection", "coupled"):
                out = engine.generate(_requests(), SamplingParams(mode, max_new_tokens=12, seed=3), policy=policy,
                                      return_hidden=True)
                assert out.stats.sd_steps > 0


def test_a_drafter_training_round_on_harvested_samples_makes_nothing_off_device():
    target = tiny_target(seed=0)
    drafter = _drafters(target.config)["eagle2"]
    engine = TorchRolloutEngine(target, drafter)
    buffer = HarvestBuffer(HarvestConfig(hidden_size=target.config.hidden_size))
    trainer = SpotTrainer(drafter, eagle_loss_fn(target),
                          SpotTrainerConfig(batch_size=2, max_steps_per_round=2, optim=DrafterOptimConfig(lr=1e-3)))
    coord = open_coordinator()
    with off_device():
        out = engine.generate(_requests(), SamplingParams("greedy", max_new_tokens=10), return_hidden=True)
        for req, res in zip(_requests(), out.results):
            buffer.add(torch.tensor(req.prompt + tuple(res.tokens), device="cpu"), res.hidden_states, step=0)
        stats = trainer.run(coord, buffer)
    assert stats.optimizer_steps == 2


class HostReads(TorchDispatchMode):
    """Counts what a GPU run would wait on, whoever does it (not the engine's own counter):
    a value read to the host (``aten._local_scalar_dense``: ``.item()``, ``int(t)``,
    ``bool(t)``, ``if t.any():``), a whole tensor read to the host (``Tensor.tolist()``,
    below the dispatcher on the CPU, so counted by `counting`), and ops whose output
    shape depends on the values (``nonzero``, boolean-mask indexing, ...), counted apart."""

    DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                      torch.ops.aten.unique_dim.default, torch.ops.aten._unique2.default,
                      torch.ops.aten.repeat_interleave.Tensor}

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.data_dependent: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif func in self.DATA_DEPENDENT or (func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.data_dependent.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(monkeypatch, engine: TorchRolloutEngine):
    """`HostReads` over ``engine``'s generate, with the reads of each decode step: the
    count at the step's start (``_choose``) and at its end (its ``StepTrace``), the
    window the engine's own ``StepTrace.host_syncs`` covers."""
    mode, marks = HostReads(), []
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        mode.reads += 1
        return tolist(t)

    choose = engine._choose

    def marked_choose(*args):
        marks.append(mode.reads)
        return choose(*args)

    def marked_trace(*args, **kwargs):
        marks.append(mode.reads)
        return StepTrace(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(engine, "_choose", marked_choose)
    monkeypatch.setattr(torch_engine, "StepTrace", marked_trace)
    with mode:
        yield mode, marks
    monkeypatch.undo()


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_host_syncs_per_decode_step_are_bounded(mode, monkeypatch):
    """One read per plain step; one more per SD step (the drafter's catch-up), plus one per
    tree depth with rejection; a step where rows finish reads their tokens (two more).
    Counted at the dispatcher (`HostReads`), so a new read anywhere in a step counts."""
    target = tiny_target(seed=0)
    shape = TreeShape(3, 2, 4)
    sampling = SamplingParams(mode, max_new_tokens=24, seed=5)
    reqs = [Request(tuple(range(3, 3 + n)), seq_id=i) for i, n in enumerate((4, 7, 5, 9, 6))]
    runs = []
    for engine, policy, base in ((TorchRolloutEngine(target), None, 1),
                                 (TorchRolloutEngine(target, _drafters(target.config)["eagle2"]),
                                  FixedSDPolicy(shape), 2 + (shape.depth if mode == "rejection" else 0))):
        with counting(monkeypatch, engine) as (seen, marks):
            out = engine.generate(reqs, sampling, policy=policy)
        runs.append(out)
        trace = out.stats.trace
        assert len(marks) == 2 * len(trace) and not seen.data_dependent, (len(marks), seen.data_dependent)
        per_step = [end - start for start, end in zip(marks[::2], marks[1::2])]
        finishing = [i + 1 == len(trace) or trace[i + 1].running < t.running for i, t in enumerate(trace)]
        quiet = [n for n, f in zip(per_step, finishing) if not f]
        assert quiet and max(quiet) <= base, (mode, base, quiet)
        assert max(per_step) <= base + 2, (mode, base, per_step)
        if mode != "rejection":  # exact where nothing depends on acceptance
            assert set(quiet) == {base}, (mode, quiet)
        # the engine's own figures are these reads (every one goes through nemo_tlt.model.host)
        assert [t.host_syncs for t in trace] == per_step
        assert out.stats.host_syncs == seen.reads
    assert runs[1].stats.sd_steps == len(runs[1].stats.trace)
