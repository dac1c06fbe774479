"""The learned SD policy: plain decoding or a tree per step from step costs shared across
batch sizes, collapse fallback with back-off probes, discount on a new drafter, state
that travels. Simulated step times are jittered (+-10 %, seeded) wherever the claim holds
with that; the tests kept on exact times say why (one known weakness is a strict xfail)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.speculative.tree_shape import TreeShape

CHAIN, TREE = TreeShape(4, 1, 4), TreeShape(6, 2, 12)
JITTER = 0.1  # a measured step takes its mean time x uniform(1 - JITTER, 1 + JITTER)


def jitter(rng: np.random.Generator) -> float:
    return float(rng.uniform(1.0 - JITTER, 1.0 + JITTER))


class Sim:
    """Step costs of a machine where SD pays below ~10 rows and plain above: plain
    t = 0.01 + 0.001 r; a tree t = 0.02 + c r and keeps `accept` tokens a row. `cost` is
    a step's mean time; what the policy observes is off by up to `jitter` (a Generator seeded
    by `seed`)."""

    def __init__(self, accept: dict = None, seed: int = 0, jitter: float = JITTER):
        self.accept = {None: 1.0, CHAIN: 4.0, TREE: 4.5} if accept is None else accept
        self.rng, self.jitter = np.random.default_rng(seed), jitter

    def cost(self, shape, r: int) -> float:
        slope = {None: 0.001, CHAIN: 0.006, TREE: 0.009}[shape]
        return (0.01 if shape is None else 0.02) + slope * r

    def rate(self, shape, r: int) -> float:
        return self.accept[shape] * r / self.cost(shape, r)

    def measured(self, shape, r: int) -> float:
        return self.cost(shape, r) * float(self.rng.uniform(1.0 - self.jitter, 1.0 + self.jitter))

    def step(self, policy, r: int):
        shape = policy.choose(r)
        policy.observe(r, shape, round(self.accept[shape] * r), self.measured(shape, r))
        return shape

    def rollout(self, policy, start: int = 256) -> list:
        """Running rows fall from `start` to 1 (a long tail: many steps at few rows)."""
        runs = [max(1, int(start * 0.9 ** i)) for i in range(80)] + [1] * 40
        return [(r, self.step(policy, r)) for r in runs]


def policy(**kw) -> LearnedSDPolicy:
    return LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN, TREE), **kw))


def oracle(sim: Sim, r: int):
    return max((None, CHAIN, TREE), key=lambda s: sim.rate(s, r))


def test_learns_plain_for_the_crowded_head_and_sd_for_the_tail():
    # Exact step times: with jitter this does not hold yet (the xfail test below).
    sim, p = Sim(jitter=0.0), policy()
    for _ in range(6):
        steps = sim.rollout(p)
    head = [s for r, s in steps if r >= 48]
    tail = [s for r, s in steps if r <= 4]
    assert head.count(None) >= 0.9 * len(head)
    assert sum(s is not None for s in tail) >= 0.9 * len(tail)
    # Exploration is bounded: in the sixth rollout the cost over the per-step oracle is small.
    spent = sum(sim.cost(s, r) / (sim.accept[s] * r) for r, s in steps)
    best = sum(sim.cost(oracle(sim, r), r) / (sim.accept[oracle(sim, r)] * r) for r, s in steps)
    assert spent <= 1.05 * best


@pytest.mark.parametrize("accept, jitter", [(None, 0.0), ({None: 1.0, CHAIN: 6.0, TREE: 4.0}, JITTER)],
                         ids=["plain_head", "sd_pays"])
def test_a_fresh_policy_pays_little_in_its_first_rollout(accept, jitter):
    # The cold case (an RL run's first step): what every step teaches is shared across
    # batch sizes, so exploration is a short start-up and a few probes, not every
    # choice in every bucket (per-bucket tables paid 1.13x here on the sd_pays machine).
    # The plain_head machine with exact step times only: with jitter see the xfail test below.
    sim, p = Sim(accept, jitter=jitter), policy()
    steps = sim.rollout(p)
    spent = sum(sim.cost(s, r) / (sim.accept[s] * r) for r, s in steps)
    best = sum(sim.cost(oracle(sim, r), r) / (sim.accept[oracle(sim, r)] * r) for r, s in steps)
    assert spent <= 1.08 * best


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "found with jittered step times: on the plain_head machine with step times off by "
    "+-3 % or more, about half the seeds never run a tree again after the start-up profile"))
def test_learns_sd_for_the_tail_whatever_the_jitter():
    """The claims of the two tests above with step times off by up to +-10 %, on six seeds.
    Today seeds 0, 2 and 5 never speculate in the tail (1.62x the per-step oracle's cost in
    the sixth rollout, 1.63x in the first; still none after 30 rollouts). The chain's probe
    in the head is a knife-edge (its optimistic bound a few % above plain's estimate at
    ~120 rows) that jitter can tip; unprobed there, the trees rest on their two start-up
    steps at ~230 rows, moved to 1 row along the pooled power law, which puts the chain at
    about half its true rate there, and the probe-cost gate (expected loss <= probe_cost x
    the median step) then refuses every tail probe. Only drafter_updated (stale arms are
    probed on back-off) unsticks it. Strict: once fixed this passes and the marker must go."""
    for seed in range(6):
        sim, p = Sim(seed=seed), policy()
        first = sim.rollout(p)
        for _ in range(5):
            steps = sim.rollout(p)
        head, tail = [s for r, s in steps if r >= 48], [s for r, s in steps if r <= 4]
        assert head.count(None) >= 0.9 * len(head), seed
        assert sum(s is not None for s in tail) >= 0.9 * len(tail), seed
        for rollout, bound in ((first, 1.08), (steps, 1.05)):
            spent = sum(sim.cost(s, r) / (sim.accept[s] * r) for r, s in rollout)
            best = sum(sim.cost(oracle(sim, r), r) / (sim.accept[oracle(sim, r)] * r) for r, s in rollout)
            assert spent <= bound * best, seed


def test_a_threshold_free_start_is_not_stuck_plain_on_a_big_batch_when_sd_pays():
    # A machine where SD pays at every batch size: the policy speculates from the head on.
    sim = Sim({None: 1.0, CHAIN: 6.0, TREE: 4.0})
    p = policy()
    head = []
    for i in range(8):
        steps = sim.rollout(p)
        if i >= 4:  # the head has 7 steps a rollout, and a measured probe takes two of them
            head += [s for r, s in steps if r >= 128]
    assert sum(s is CHAIN for s in head) >= 0.8 * len(head)


def test_collapse_is_noticed_within_a_few_sd_steps_and_probed_on_back_off():
    sim = Sim({None: 1.0, CHAIN: 1.0, TREE: 1.0})  # an untrained drafter: nothing accepted
    p = policy()
    sd_before = 0
    for r in [8] * 50:
        shape = sim.step(p, r)
        if p.collapsed:
            break
        sd_before += shape is not None
    assert p.collapsed and sd_before <= 3
    probes = [sim.step(p, 8) for _ in range(2000)]
    sd = [i for i, s in enumerate(probes) if s is not None]
    assert 3 <= len(sd) <= 8, sd  # 16, 32, 64, ... steps apart, capped at 1024
    assert all(probes[i] is CHAIN for i in sd)  # the cheapest tree probes
    gaps = [b - a for a, b in zip(sd, sd[1:])]
    assert gaps == sorted(gaps)


def test_one_sd_step_of_a_crowded_batch_is_enough_to_notice_a_collapse():
    # 32 rows accepting nothing: the pooled evidence of one step is 32 rows (>= collapse_rows),
    # so the first SD step (of the start-up profile, after plain's pulls) already decides.
    sim = Sim({None: 1.0, CHAIN: 1.0, TREE: 1.0})
    p = policy()
    shapes = []
    while not p.collapsed:
        shapes.append(sim.step(p, 32))
    assert sum(s is not None for s in shapes) == 1
    assert all(sim.step(p, 32) is None for _ in range(10))


def test_a_retrained_drafter_is_picked_up_soon_after_drafter_updated():
    sim = Sim({None: 1.0, CHAIN: 1.0, TREE: 1.0})
    p = policy()
    for _ in range(3000):
        sim.step(p, 4)
    assert p.collapsed and p.guard.backoff.wait == 1024  # unannounced, the next probe could be 1024 steps away
    sim.accept = {None: 1.0, CHAIN: 4.0, TREE: 4.5}
    p.drafter_updated()
    steps = [sim.step(p, 4) for _ in range(60)]
    assert not p.collapsed
    assert sum(s is not None for s in steps[-20:]) >= 18


def test_drafter_updated_halves_tree_windows_and_keeps_plain():
    sim, p = Sim(), policy()
    for _ in range(3):
        sim.rollout(p)
    octaves = [{k: len(v) for k, v in p.costs._steps[a].items()} for a in range(3)]
    p.drafter_updated()
    after = [{k: len(v) for k, v in p.costs._steps[a].items()} for a in range(3)]
    assert after[0] == octaves[0]
    assert after[1:] == [{k: n - n // 2 for k, n in o.items()} for o in octaves[1:]]
    assert all(n >= 1 for o in after for n in o.values())


def test_choices_depend_on_the_measured_cost_not_on_a_threshold():
    # The same policy on two machines whose break-even differs decides differently at 32 rows.
    picks = {}
    for name, accept in (("sd_pays", {None: 1.0, CHAIN: 6.0, TREE: 4.0}), ("plain_pays", None)):
        sim, p = Sim(accept), policy()
        for _ in range(5):
            steps = sim.rollout(p)
        picks[name] = [s for r, s in steps if 28 <= r <= 36]
    assert all(s is not None for s in picks["sd_pays"][-3:])
    assert all(s is None for s in picks["plain_pays"][-3:])


def test_max_sd_running_bounds_speculation():
    sim = Sim({None: 1.0, CHAIN: 6.0, TREE: 4.0})
    p = policy(max_sd_running=16)
    for _ in range(3):
        steps = sim.rollout(p)
    assert all(s is None for r, s in steps if r > 16)
    assert any(s is not None for r, s in steps if r <= 16)


def test_state_round_trip_through_json_gives_identical_future_choices():
    sim = Sim()
    a = policy()
    for _ in range(2):
        sim.rollout(a)
    for _ in range(200):  # into a collapse, so its state travels too
        Sim({None: 1.0, CHAIN: 1.0, TREE: 1.0}).step(a, 3)
    b = policy()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [s for _, s in Sim(seed=1).rollout(a)] == [s for _, s in Sim(seed=1).rollout(b)]  # the same timings
    assert a.state_dict() == b.state_dict()


def test_bad_state_is_refused_and_changes_nothing():
    p = policy()
    Sim().rollout(p)
    good = json.loads(json.dumps(p.state_dict()))
    other = LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN,)))
    with pytest.raises(ValueError, match="arms"):
        other.load_state_dict(good)
    broken = json.loads(json.dumps(good))
    broken["collapse"]["recent"] = "x"
    fresh = policy()
    with pytest.raises(ValueError, match="recent"):
        fresh.load_state_dict(broken)
    assert fresh.state_dict() == policy().state_dict()
    for bad in (None, {"kind": "threshold"}, {**good, "version": 9}):
        with pytest.raises(ValueError, match="LearnedSDPolicy state"):
            p.load_state_dict(bad)


def test_a_version_1_state_of_per_bucket_tables_is_refused_by_name():
    p = policy()
    Sim().rollout(p)
    old = {"version": 1, "kind": "learned", "arms": [CHAIN.name, TREE.name], "table": {}, "collapse": {},
           "previous": None, "pending": None}
    before = p.state_dict()
    with pytest.raises(ValueError, match="version 1 .*per-bucket.*cannot carry it over"):
        p.load_state_dict(old)
    assert p.state_dict() == before


def test_observe_refuses_an_unknown_shape_and_bad_outcomes():
    p = policy()
    with pytest.raises(ValueError, match="neither None"):
        p.observe(4, TreeShape(2, 1, 2), 8, 0.1)
    with pytest.raises(ValueError, match="elapsed_s"):
        p.observe(4, None, 4, 0.0)
    with pytest.raises(ValueError, match="num_running"):
        p.choose(0)


@pytest.mark.parametrize("kwargs, match", [
    ({"arms": ()}, "arms"),
    ({"arms": (CHAIN, CHAIN)}, "duplicates"),
    ({"arms": ("4_1",)}, r"arms\[0\]"),
    ({"bandwidth": 1.0}, "bandwidth"),
    ({"probe_spread": -0.1}, "probe_spread"),
    ({"min_pulls": 20}, "min_pulls"),
    ({"probe_longest": 4}, "probe_longest"),
    ({"collapse_accept": 0.5}, "collapse_accept"),
    ({"collapse_rows": 0}, "collapse_rows"),
    ({"exponent_error": 1.5}, "exponent_error"),
    ({"probe_cost": -0.1}, "probe_cost"),
    ({"max_sd_running": 0}, "max_sd_running"),
])
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearnedSDConfig(**({"arms": (CHAIN,)} | kwargs))


def test_is_a_spec_policy_and_logs():
    p = policy()
    Sim().rollout(p)
    assert isinstance(p, SpecPolicy)
    log = p.log_dict()
    assert log["sd_policy/collapsed"] == 0.0
    assert any(k.endswith("/tokens_per_s/plain") for k in log)


def costs(num_arms: int, **kw):
    from nemo_tlt.adaptive.arm_costs import ArmCosts
    args = dict(window=8, min_pulls=1, bandwidth=2.0, spread=0.3, exponent_error=0.25, probe_shortest=4,
                probe_longest=64) | kw
    return ArmCosts(num_arms, **args)


def record_rate(table, r: int, arm: int, tokens_per_row: float, seconds: float) -> None:
    table.record(r, arm, round(tokens_per_row * r), seconds)


def test_arms_pulled_at_different_batch_sizes_compare_at_the_batch_size_decided():
    # Steps cost 0.01 * r**0.3 for both arms; arm 2 keeps 3.3 tokens a row, arm 1 3.0.
    # Arm 1 only ran at 60 rows and arm 2 at 33 lately: by raw throughput arm 1 looks
    # better (more rows); moved to the same batch size, arm 2 wins.
    # Exact step times: with +-10 % jitter the fitted exponent misses 0.3 +- 0.01 on some seeds.
    table = costs(3)
    for arm, acc in ((1, 3.0), (2, 3.3)):  # the fit: each arm at several batch sizes of the tail
        for r in (1, 2, 3, 5, 7, 9, 12, 15):
            record_rate(table, r, arm, acc, 0.01 * r ** 0.3)
    for _ in range(3):
        record_rate(table, 60, 1, 3.0, 0.01 * 60 ** 0.3)
        record_rate(table, 33, 2, 3.3, 0.01 * 33 ** 0.3)
    assert table.exponent(1) == pytest.approx(0.3, abs=0.01)
    assert table.best(40) == 2 and table.best(60) == 2


def test_a_step_informs_every_batch_size_moved_along_the_fitted_cost_curve():
    # One arm measured only in the head (48-64 rows) and in the middle (8-12): its
    # estimate at 2 rows, where it never ran, follows its cost curve t = 0.01 r**0.5,
    # and the steps near the batch size decided count most.
    table = costs(2)
    for r in (64, 56, 48, 12, 10, 8):
        record_rate(table, r, 1, 4.0, 0.01 * r ** 0.5)
    value, _, near = table.estimate(1, 2)
    assert value == pytest.approx(4.0 * 2 / (0.01 * 2 ** 0.5), rel=0.02)
    assert near < 1.0 < table.estimate(1, 10).near
    assert table.estimate(0, 2) is None


def test_a_clearly_worse_arm_is_not_probed_and_a_close_one_ever_more_rarely():
    for rates, probed in (((10.0, 20.0), False), ((19.0, 20.0), True)):
        table = costs(2)
        picks = []
        for _ in range(300):
            arm = table.choose(3)
            table.record(3, arm, 1000, 1000 / rates[arm])
            picks.append(arm)
        probes = [i for i, a in enumerate(picks) if a == 0][1:]  # after the start-up pull
        if not probed:
            assert probes == []
            continue
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert gaps == sorted(gaps) and gaps[-1] == 64 and 3 <= len(probes) <= 8, probes


def test_a_plausible_arm_is_probed_where_it_has_not_been_measured():
    # Both trees ran in the head (48-64 rows), tree 2 a bit behind; plain far behind
    # everywhere. At 6 rows neither tree has steps near: tree 2 is probed there at
    # once (its estimate rests on no step near 6), plain is not (clearly worse).
    # Exact step times: with +-10 % jitter tree 2 (5 % behind) can measure ahead at 6 rows.
    table = costs(3, probe_shortest=64, probe_longest=64)
    for r in (64, 56, 48):
        record_rate(table, r, 0, 1.0, 0.01 * r ** 0.5)
        record_rate(table, r, 1, 4.0, 0.01 * r ** 0.5)
        record_rate(table, r, 2, 3.8, 0.01 * r ** 0.5)
    picks = []
    for _ in range(6):
        picks.append(table.choose(6))
        record_rate(table, 6, picks[-1], (1.0, 4.0, 3.8)[picks[-1]], 0.01 * 6 ** 0.5)
    assert 2 in picks and 0 not in picks
    assert picks.count(1) >= 4  # once tree 2 is measured near 6, its back-off (64 steps) holds it


def test_rollout_block_builds_the_learned_policy_and_validates_its_fields():
    import numpy as np
    from nemo_tlt.config import load_config
    cfg = load_config(None, ["rollout.sd_policy=learned", "rollout.learned.max_sd_running=12",
                             "rollout.learned.collapse_accept=1.5", "rollout.learned.arms=['4_1_4','6_2_12']",
                             "rollout.learned.bandwidth=3.0"]).rollout
    policy = cfg.build_policy(np.random.default_rng(0))
    assert isinstance(policy, LearnedSDPolicy) and policy.config is cfg.learned
    assert cfg.learned.arms == (CHAIN, TREE) and cfg.learned.bandwidth == 3.0
    assert (cfg.learned.max_sd_running, cfg.learned.collapse_accept) == (12, 1.5)
    assert load_config(None, []).rollout.sd_policy == "threshold"
    assert load_config(None, ["rollout.sd_enabled=false"]).rollout.build_policy(np.random.default_rng(0)) is None
    for bad, match in ((["rollout.sd_policy=always"], "rollout.sd_policy"),
                       (["rollout.learned.max_sd_running=0"], "rollout.learned.max_sd_running"),
                       (["rollout.learned.collapse_accept=0.9"], "rollout.learned.collapse_accept"),
                       (["rollout.learned.bandwidth=0.5"], "rollout.learned.bandwidth")):
        with pytest.raises(ValueError, match=match):
            load_config(None, bad)


def test_the_drafter_catch_up_after_plain_steps_is_kept_out_of_the_estimates():
    # The first SD step after plain steps (or of a rollout) also runs the drafter over
    # the positions it has not seen: 10x slower here. Both trees pay it alike, so it must
    # not decide between them: the tree that happens to run first is not penalised.
    # Exact step times: with +-10 % jitter the trees' estimates at 4 rows (moved along an
    # exponent fitted on 4-6 rows) miss 5 % on about a third of seeds, however many rounds.
    p = policy(min_pulls=1)
    sim = Sim()
    for _ in range(3):
        previous = None
        for r in (6, 6, 6, 5, 5, 5, 4, 4, 4, 4, 4, 4):
            shape = p.choose(r)
            slow = shape is not None and (previous is None or previous[1] is None or r > previous[0])
            p.observe(r, shape, round(sim.accept[shape] * r), sim.cost(shape, r) * (10 if slow else 1))
            previous = (r, shape)
    est = {a: p.costs.estimate(a, 4).value for a in range(3)}
    assert est[1] == pytest.approx(sim.rate(CHAIN, 4), rel=0.05)
    assert est[2] == pytest.approx(sim.rate(TREE, 4), rel=0.05)


def test_a_tree_that_loses_to_plain_then_improves_is_adopted():
    """Probes of a tree in a bucket where plain leads follow plain steps, so their first
    step only catches the drafter up; the policy must still measure the tree, or a
    drafter improved by idle-time training is never picked up there."""
    p = LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN,)))
    rates, rng = {None: 40.0, CHAIN: 30.0}, np.random.default_rng(0)
    late = []
    for step in range(300):
        if step == 20:
            rates[CHAIN] = 60.0   # the drafter got better (without collapsing before)
            p.drafter_updated()
        shape = p.choose(8)
        p.observe(8, shape, 16, 16 / rates[shape] * jitter(rng))
        if step >= 200:
            late.append(shape)
    assert sum(s == CHAIN for s in late) >= 0.8 * len(late)


def test_pending_measurement_travels_with_the_state():
    p = LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN,)))
    rates = {None: 40.0, CHAIN: 36.0}
    for step in range(200):  # plain leads, the tree close behind; stop right after a probe's catch-up step
        shape = p.choose(8)
        p.observe(8, shape, 16, 16 / rates[shape])
        if step > 10 and shape == CHAIN:
            break
    assert shape == CHAIN
    state = json.loads(json.dumps(p.state_dict()))
    q, without = policy_like(p), policy_like(p)
    q.load_state_dict(state)
    without.load_state_dict({**state, "pending": None})
    assert q.choose(8) == CHAIN == p.choose(8)  # the probe is measured after the resume too
    assert without.choose(8) is None


def policy_like(p: LearnedSDPolicy) -> LearnedSDPolicy:
    return LearnedSDPolicy(p.config)


def test_a_new_rollout_with_as_many_rows_starts_with_an_unrecorded_catch_up():
    """Rows cut off at max_new_tokens end a rollout with as many rows as the next starts
    with: the engine's begin_rollout, not the running count, marks the new rollout."""
    p = LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN,)))
    for _ in range(6):
        shape = p.choose(8)
        p.observe(8, shape, 32 if shape else 8, 0.1)
    pulls = p.costs.pulls()
    p.begin_rollout()
    p.observe(8, CHAIN, 32, 5.0)  # the slow catch-up step of the new rollout
    assert p.costs.pulls() == pulls


def test_a_probe_far_behind_goes_where_steps_are_cheap_not_to_the_crowded_head():
    # Arm 0 is 10% behind arm 1 at every batch size; a step's time grows like the batch
    # (b = 1), so a step at 64 rows costs 16 of one at 4. Each "rollout" has one step at
    # 64 rows and ten at 4. A probe of arm 0 in the head would lose 16x what one in the
    # tail loses: arm 0 is still probed, but only at 4 rows.
    # Exact step times: with +-10 % jitter (as wide as the 10 % gap) the head is probed on some seeds.
    def run(probe_cost):
        table = costs(2, probe_cost=probe_cost)
        probes = {64: 0, 4: 0}
        for rollout in range(60):
            for r in [64] + [4] * 10:
                arm = table.choose(r)
                record_rate(table, r, arm, 4.0, 0.001 * r * (1.1 if arm == 0 else 1.0))
                if rollout >= 2 and arm == 0:
                    probes[r] += 1
        return probes

    gated, ungated = run(0.25), run(math.inf)
    assert gated[64] == 0 and gated[4] >= 3, gated
    assert ungated[64] >= 1, ungated  # what the gate prevents


def test_probe_loss_is_the_time_beyond_the_best_arm_for_the_same_tokens():
    table = costs(2)
    for r in (4, 8, 16):
        record_rate(table, r, 0, 2.0, 0.001 * r * 1.25)
        record_rate(table, r, 1, 2.0, 0.001 * r)
    # 2 tokens a row at 8 rows: 16 tokens; arm 0 needs 0.010 s, arm 1 0.008 s.
    assert table.probe_loss(0, 1, 8) == pytest.approx(0.002, rel=0.02)
    assert table.probe_loss(1, 0, 8) == 0.0
    assert table.median_step() == pytest.approx(0.009)
    assert costs(2).probe_loss(0, 1, 8) is None
    empty = costs(2, probe_cost=0.25)  # steps that kept no tokens price no probe (and do not divide by 0)
    for _ in range(6):
        empty.record(4, empty.choose(4), 0, 0.01)
    assert empty.probe_loss(0, 1, 4) is None


def test_the_first_step_of_a_rollout_probes_no_tree_while_a_tree_leads():
    # Two trees close in the head (8 rows: the second's step 4% slower), the second
    # clearly behind in the tail (1.6x the first's step at one row: its step time grows
    # like r**0.3, the first's like r**0.5); plain far behind. The second tree's back-off
    # falls due in the tail, where it is not plausible, so its probe would wait for the
    # next rollout's first step, which also catches the drafter up and is not measured:
    # a probe there needs a second step to be measured, both in the most crowded steps.
    # Probes go to later steps.
    def seconds(shape, r):
        return 0.63 * r ** 0.3 if shape == TREE else 0.4 * r ** 0.5 * (3.0 if shape is None else 1.0)

    # Exact step times: with +-10 % jitter the second tree (4 % behind at 8 rows) sometimes
    # leads there, and the first steps then run it as the best, not as a probe.
    def run(catch_up_aware):
        p = policy(min_pulls=1)
        if not catch_up_aware:
            choose = p.costs.choose
            p.costs.choose = lambda running, catch_up=False: choose(running)
        first, later = [], []
        for _ in range(120):
            p.begin_rollout()
            for i, r in enumerate((8, 8, 7, 6, 5, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1)):
                shape = p.choose(r)
                p.observe(r, shape, (1 if shape is None else 4) * r, seconds(shape, r))
                (first if i == 0 else later).append(shape)
        return first[10:], later  # once the estimates settled (b fitted)

    first, later = run(True)
    assert set(first) == {CHAIN}, first
    assert later.count(TREE) >= 3
    assert TREE in run(False)[0]  # what the catch-up rule prevents


def test_more_running_rows_than_the_last_step_start_an_unrecorded_catch_up():
    """Without begin_rollout (an engine that does not call it), a step with more running
    rows than the last one is a new rollout's first: its catch-up is not recorded."""
    p = LearnedSDPolicy(LearnedSDConfig(arms=(CHAIN,)))
    for _ in range(6):
        shape = p.choose(8)
        p.observe(8, shape, 32 if shape else 8, 0.1)
    assert shape == CHAIN  # the last step ran the tree: no catch-up for that reason
    pulls = p.costs.pulls()
    p.observe(12, CHAIN, 48, 5.0)
    assert p.costs.pulls() == pulls
    p.observe(12, CHAIN, 48, 0.1)
    assert p.costs.pulls()[1] == pulls[1] + 1
