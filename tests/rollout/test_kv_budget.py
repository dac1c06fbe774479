"""The torch engine under a KV budget (``rollout.kv_cache_gib``): the KV bytes it holds never
pass the budget, a budget that binds changes no token (greedy and coupled, plain and
speculative), a budget that does not bind changes nothing at all, a request that can never fit
is refused by name, and the planner's rule gives the engine's slot and row counts. The same
budget as ``rollout.kv_cache_fraction``: that fraction of the free memory read at every call (a
stand-in gives the free memory), the smallest of a TP group's ranks."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, SDPolicyConfig
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.model.kv_budget import GIB, admission_waves
from nemo_tlt.plan.memory import RolloutShape, kv_budget_rows, kv_budget_slots, rollout_kv_slot_bytes
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.kv_admission import engine_slot_bytes
from nemo_tlt.rollout.kv_limit import KVLimit, round_up
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.row_batch import RowBatch
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import tiny_target

NEW = 48
# tiny target (2 layers, 2 KV heads of 8) and EAGLE (1 layer) in fp32: 256 + 128 B per slot;
# 24 rows of <= 8 + 48 slots need ~516 KB, so this budget (~165 KB) holds 7 of them at a time
BUDGET_GIB = 160 * 1024 / GIB * 1.03


def _policy():
    """SD with one tree shape once <= 6 rows run: deterministic (no timings)."""
    return AdaptiveSDPolicy(SDPolicyConfig(threshold_on=6, threshold_off=8), fixed_shape=TreeShape(3, 2, 6))


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=3, scale=5.0)
    drafter = EagleDrafter(EagleConfig.from_target(target.config), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(3, 32, (int(n),), generator=g).tolist())   # no seq_id: keyed by index
            for n in torch.randint(2, 9, (24,), generator=g)]
    return target, drafter, reqs


@pytest.fixture
def peaks(monkeypatch):
    """The KV bytes a RowBatch holds after every growth (the trace has them after every step)."""
    seen: list[int] = []
    reserve = RowBatch.reserve

    def spy(self, slots, used):
        reserve(self, slots, used)
        seen.append(self.kv_bytes())
    monkeypatch.setattr(RowBatch, "reserve", spy)
    return seen


def _run(target, drafter, reqs, mode, budget, sd, seen=None):
    engine = TorchRolloutEngine(target, drafter if sd else None, initial_slots=4, kv_cache_gib=budget)
    sp = SamplingParams(mode=mode, temperature=1.0, max_new_tokens=NEW, seed=4, stop_on_eos=False)
    finished = {}
    out = engine.generate(reqs, sp, policy=_policy() if sd else None, return_hidden=True,
                          on_finish=lambda i, r: finished.setdefault(i, r))
    assert all(finished[i] is r for i, r in enumerate(out.results))  # on_finish: the call's own indices
    return out


@pytest.mark.parametrize("sd", [False, True], ids=["plain", "sd"])
def test_kv_bytes_never_pass_the_budget(setup, peaks, sd):
    target, drafter, reqs = setup
    out = _run(target, drafter, reqs, "greedy", BUDGET_GIB, sd)
    held = peaks + [t.kv_bytes for t in out.stats.trace]
    unbounded = _run(target, drafter, reqs, "greedy", None, sd)
    assert max(t.kv_bytes for t in unbounded.stats.trace) > BUDGET_GIB * GIB, "the budget must bind"
    assert max(held) <= BUDGET_GIB * GIB
    assert max(held) > BUDGET_GIB * GIB / 2  # used, not starved
    assert out.stats.prefill_forwards >= 3  # waves of at most 13 (plain) or 7 (SD) rows: a prefill or more each
    assert out.stats.sd_steps > 0 if sd else out.stats.sd_steps == 0


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("sd", [False, True], ids=["plain", "sd"])
def test_a_binding_budget_changes_no_token(setup, mode, sd):
    """Rows decoded in waves get the tokens of one batch; their log-probs and hidden states
    agree within fp32 rounding (a CPU matmul rounds a row differently beside other rows)."""
    target, drafter, reqs = setup
    full = _run(target, drafter, reqs, mode, None, sd)
    waves = _run(target, drafter, reqs, mode, BUDGET_GIB, sd)
    assert [r.tokens for r in waves.results] == [r.tokens for r in full.results]
    for a, b in zip(waves.results, full.results):
        assert a.stop_reason == b.stop_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sd", [False, True], ids=["plain", "sd"])
def test_a_budget_that_does_not_bind_changes_nothing(setup, sd):
    target, drafter, reqs = setup
    full = _run(target, drafter, reqs, "coupled", None, sd)
    roomy = _run(target, drafter, reqs, "coupled", 1.0, sd)
    for a, b in zip(roomy.results, full.results):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.hidden_states, b.hidden_states)
    assert [t.kv_bytes for t in roomy.stats.trace] == [t.kv_bytes for t in full.stats.trace]


def test_a_request_that_can_never_fit_is_refused(setup):
    target, drafter, reqs = setup
    engine = TorchRolloutEngine(target, drafter, kv_cache_gib=40 * 384 / GIB)  # 40 slots of 384 B for one row
    sp = SamplingParams(mode="greedy", max_new_tokens=NEW)
    longest = max(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    need = len(reqs[longest].prompt) + NEW
    with pytest.raises(ValueError, match=rf"rollout\.kv_cache_gib=.* \(15360 B\) holds 40 cache slots for one row "
                                         rf"at 384 B per slot .* request {longest} needs .* = {need}"):
        engine.generate(reqs, sp)
    engine.load_drafter(None)  # 256 B per slot: 60 slots, room for one row of <= 8 + 48
    assert len(engine.generate(reqs, sp).results) == len(reqs)


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib must be > 0"):
        RolloutConfig(kv_cache_gib=0.0)
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib bounds the torch engine.*rollout\.vllm\.kv_cache_gib"):
        RolloutConfig(engine="vllm", kv_cache_gib=1.0)
    assert RolloutConfig(kv_cache_gib=0.5).kv_cache_gib == 0.5
    with pytest.raises(ValueError, match=r"TorchRolloutEngine\.kv_cache_gib \(rollout\.kv_cache_gib\) must be > 0"):
        TorchRolloutEngine(tiny_target(), kv_cache_gib=-1.0)


def test_the_planner_and_the_engine_agree(setup, monkeypatch):
    """Equal prompts P and max_new_tokens M: the planner's rows at once for a context of P + M
    are the engine's wave size, and its slots per row for that many rows the engine's cap."""
    target, drafter, _ = setup
    P, rows, budget = 6, 10, 0.0001
    reqs = [Request([3 + i % 20] * P) for i in range(rows)]
    shape = RolloutShape(tp=1, concurrency=rows, context=P + NEW, sd=True, kv_cache_gib=budget)
    slot = engine_slot_bytes(target, drafter)
    assert slot == rollout_kv_slot_bytes(target.config, 1, True, kv_bytes=4) == 384
    per_wave = kv_budget_rows(target.config, shape, kv_bytes=4)
    assert 1 < per_wave < rows
    waves: list[tuple[int, int]] = []  # (rows, most slots per row) of each wave's batch
    prefill = TorchRolloutEngine._prefill

    def spy(self, *args):
        batch = prefill(self, *args)
        waves.append((batch.rows.numel(), batch.max_slots))
        return batch
    monkeypatch.setattr(TorchRolloutEngine, "_prefill", spy)
    TorchRolloutEngine(target, drafter, kv_cache_gib=budget).generate(reqs, SamplingParams(max_new_tokens=NEW),
                                                                        policy=_policy())
    assert [n for n, _ in waves] == [per_wave] * (rows // per_wave)
    for n, max_slots in waves:
        assert max_slots == kv_budget_slots(target.config, shape, n, kv_bytes=4) < P + NEW + 256 + 2


def test_admission_waves_by_hand():
    # budget 100 B, 1 B per slot: rows of needs 10, 20, 30, 40, 50 -> (10, 20, 30) holds 3 x 30
    assert admission_waves([10, 20, 30, 40, 50], 100, 1) == [(0, 3), (3, 5)]
    assert admission_waves([50, 50, 10], 100, 1) == [(0, 2), (2, 3)]
    assert admission_waves([], 100, 1) == []
    with pytest.raises(ValueError, match="row 1 needs 101 slots"):
        admission_waves([1, 101], 100, 1)


class _Free:
    """A stand-in for the device's free memory (``kv_limit.free_bytes``): the values given, one per
    read, and the devices it was read on."""

    def __init__(self, *values: int) -> None:
        self.values, self.devices = list(values), []

    def __call__(self, device) -> int:
        self.devices.append(torch.device(device))
        return self.values.pop(0)


def test_a_fraction_of_free_memory_is_read_at_every_call(setup, monkeypatch):
    """``kv_cache_fraction`` f with F bytes free is the budget of int(f x F) bytes (same waves, caps
    and KV bytes step by step as ``kv_cache_gib`` of that many bytes), read anew each call: the
    memory freed between calls is the next call's."""
    target, drafter, reqs = setup
    budget = int(BUDGET_GIB * GIB)
    free = _Free(4 * budget, 2 * budget + 1, 10 ** 12)
    monkeypatch.setattr("nemo_tlt.rollout.kv_limit.free_bytes", free)
    engine = TorchRolloutEngine(target, drafter, initial_slots=4, kv_cache_fraction=0.5)
    sp = SamplingParams(mode="coupled", temperature=1.0, max_new_tokens=NEW, seed=4, stop_on_eos=False)
    calls, budgets = [], []
    for _ in range(3):
        calls.append(engine.generate(reqs, sp, policy=_policy()))
        budgets.append(engine.last_kv_budget.bytes)
    assert free.devices == [torch.device("cpu")] * 3 and budgets == [2 * budget, budget, 10 ** 12 // 2]
    fixed = _run(target, drafter, reqs, "coupled", BUDGET_GIB, True)
    unbounded = _run(target, drafter, reqs, "coupled", None, True)
    for out, like in zip(calls, (None, fixed, unbounded)):
        assert [r.tokens for r in out.results] == [r.tokens for r in fixed.results]
        if like is not None:
            assert [t.kv_bytes for t in out.stats.trace] == [t.kv_bytes for t in like.stats.trace]
    assert max(t.kv_bytes for t in calls[0].stats.trace) <= 2 * budget  # f x F of the first read
    assert max(t.kv_bytes for t in calls[0].stats.trace) > max(t.kv_bytes for t in fixed.stats.trace)
    assert calls[0].stats.prefill_forwards < fixed.stats.prefill_forwards  # fewer, larger waves


def test_a_fraction_too_small_for_a_request_is_refused_by_name(setup, monkeypatch):
    """The refusal names the setting and the free memory, and says which fraction would hold the
    longest request, or that none would."""
    target, drafter, reqs = setup
    free = 2 * 40 * 384 + 1
    monkeypatch.setattr("nemo_tlt.rollout.kv_limit.free_bytes", _Free(free, 500))
    engine = TorchRolloutEngine(target, drafter, kv_cache_fraction=0.5)
    sp = SamplingParams(mode="greedy", max_new_tokens=NEW)
    need = (max(len(r.prompt) for r in reqs) + NEW) * 384
    with pytest.raises(ValueError, match=rf"rollout\.kv_cache_fraction=0\.5 of .* GiB free on cpu \(15360 B\) holds "
                                         rf"40 cache slots for one row .* raise rollout\.kv_cache_fraction to at "
                                         rf"least {round_up(need / free)}, or shorten"):
        engine.generate(reqs, sp)
    with pytest.raises(ValueError, match=rf"no rollout\.kv_cache_fraction holds it: {need} B is more than the 500 B "
                                         r"free"):
        engine.generate(reqs, sp)


class _Group:
    """A TensorParallel stand-in: ``gather_int`` returns this rank's value beside the others'."""
    size, rank = 3, 1

    def __init__(self, others: list[int]) -> None:
        self.others, self.gathered = others, []

    def gather_int(self, value: int) -> list[int]:
        self.gathered.append(value)
        return [self.others[0], value, *self.others[1:]]


def test_tensor_parallel_ranks_take_the_smallest_free_memory(monkeypatch):
    monkeypatch.setattr("nemo_tlt.rollout.kv_limit.free_bytes", _Free(1000, 1000))
    limit = KVLimit(fraction=0.5)
    group = _Group([1200, 800])
    assert limit.budget(torch.device("cpu"), group).bytes == 400 and group.gathered == [1000]
    assert limit.budget(torch.device("cpu"), None).bytes == 500  # alone: its own
    assert KVLimit(gib=1.0).budget(torch.device("cpu"), group).bytes == GIB and group.gathered == [1000]
    assert KVLimit().budget(torch.device("cpu"), group) is None


def test_round_up_never_advises_a_setting_below_the_need():
    assert round_up(0.123412) == 0.1235 and round_up(0.1234) == 0.1234 and round_up(5.00001e-5) == 5.001e-5
    assert all(round_up(x) >= x for x in (1 / 3, 2 / 3, 0.99999, 1e-7 / 3))


def test_a_rank_that_cannot_read_its_free_memory_stops_the_group(monkeypatch):
    """It still takes part in the gather (with -1), so no rank waits, and every rank raises."""
    def broken(device):
        raise RuntimeError("CUDA error: device unavailable")
    monkeypatch.setattr("nemo_tlt.rollout.kv_limit.free_bytes", broken)
    group = _Group([1200, 800])
    with pytest.raises(RuntimeError, match="device unavailable"):
        KVLimit(fraction=0.5).budget(torch.device("cpu"), group)
    assert group.gathered == [-1]
    monkeypatch.setattr("nemo_tlt.rollout.kv_limit.free_bytes", _Free(1000))
    with pytest.raises(RuntimeError, match=r"TP ranks \[2\] could not read their free memory"):
        KVLimit(fraction=0.5).budget(torch.device("cpu"), _Group([1200, -1]))


def test_fraction_settings_are_checked_by_name():
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match=r"rollout\.kv_cache_fraction must be"):
            RolloutConfig(kv_cache_fraction=bad)
    with pytest.raises(ValueError, match=r"two budgets for one KV cache"):
        RolloutConfig(kv_cache_gib=1.0, kv_cache_fraction=0.5)
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_fraction bounds the torch engine.*"
                                         r"rollout\.vllm\.gpu_memory_utilization"):
        RolloutConfig(engine="vllm", kv_cache_fraction=0.5)
    assert RolloutConfig(kv_cache_fraction=1.0).kv_cache_fraction == 1.0
    with pytest.raises(ValueError, match=r"TorchRolloutEngine\.kv_cache_fraction \(rollout\.kv_cache_fraction\) "
                                         r"must be <= 1"):
        TorchRolloutEngine(tiny_target(), kv_cache_fraction=2.0)
    with pytest.raises(ValueError, match=r"TorchRolloutEngine: kv_cache_gib=1\.0 and kv_cache_fraction=0\.5"):
        TorchRolloutEngine(tiny_target(), kv_cache_gib=1.0, kv_cache_fraction=0.5)
    with pytest.raises(ValueError, match=r"kv_cache_fraction .* free memory is read on cuda or cpu devices, not on "
                                         r"'meta'"):
        TorchRolloutEngine(tiny_target().to("meta"), kv_cache_fraction=0.5)


def test_the_factory_builds_the_runs_budget():
    from nemo_tlt.demo.shipped_assets import SHIPPED_DIR
    from nemo_tlt.rollout.factory import build_rollout_engine
    for config in (RolloutConfig(kv_cache_fraction=0.3), RolloutConfig(kv_cache_gib=0.5), RolloutConfig()):
        engine = build_rollout_engine(config, str(SHIPPED_DIR / "target"))
        assert engine.kv_limit == KVLimit(config.kv_cache_gib, config.kv_cache_fraction)
