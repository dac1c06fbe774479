"""MegatronPolicy (real megatron-core, gloo, CPU) against the plain-PyTorch TorchPolicy.

Two worlds (forked ranks): one process at TP=1, and two processes running TP=2, PP=2
(Qwen2-style, tied embeddings) and DP=2 (the batch split over replicas) in turn.
Every case starts from the same canonical weights as a ``TorchPolicy`` reference
on the whole batch, and must reproduce its log-probs, update stats (DP: the global
grad norm, and loss shares that sum to its loss), updated weights and captured hidden
states; the TP=2 case's batch is a rollout of the torch engine, whose harvested hidden
states the megatron backend's must equal (drafter data "for free" is the same data).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from megatron_backend_workers import PolicyCase, session  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.weights.rollout import rollout_slice  # noqa: E402
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from nemo_tlt.model.config import LMConfig  # noqa: E402
from nemo_tlt.model.lm import DecoderLM  # noqa: E402
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig  # noqa: E402
from nemo_tlt.policy.megatron_backend import MegatronPolicy, check_policy_model  # noqa: E402
from nemo_tlt.policy.torch_backend import TorchPolicy, build_decoder  # noqa: E402
from nemo_tlt.rollout.protocol import Request  # noqa: E402
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine  # noqa: E402
from nemo_tlt.speculative.sampling import SamplingParams  # noqa: E402

VOCAB = 100  # not a multiple of 128 * tp: padded vocab rows must be masked out of the softmax
LLAMA = LMConfig(family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2)
QWEN_TIED = LMConfig(family="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0)
OPTIM = PolicyOptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.5)


def _policy(tp: int = 1, pp: int = 1) -> PolicyConfig:
    return PolicyConfig(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp, kl_coef=0.05, micro_batch=2,
                        optim=OPTIM)


def _weights(cfg: LMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical weights with non-trivial norms and biases (unit norms would hide a swap)."""
    g = torch.Generator().manual_seed(seed)
    model = DecoderLM(cfg).init_weights_(g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _batch(seed: int, n: int = 5) -> tuple[list, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    batch = [(tokens(2, 6), tokens(1, 9)) for _ in range(n)]
    return batch, torch.randn(n, generator=g)


def _rollout(cfg: LMConfig, weights: dict, seed: int, n: int = 5, capture_layers: tuple[int, ...] | None = None
             ) -> tuple[list, torch.Tensor, list]:
    """A batch the torch rollout engine generated (sampled, so lengths differ), with the
    hidden states it harvests: ``[prompt_len + len(tokens) - 1, H]`` per sequence; with
    ``capture_layers`` an EAGLE-3 drafter capturing them is loaded (the rollout stays
    plain), so it harvests ``[prompt_len + len(tokens) - 1, (k + 1) * H]``."""
    batch, adv = _batch(seed, n)
    engine = TorchRolloutEngine(build_decoder(weights, cfg).eval())
    if capture_layers is not None:
        engine.load_drafter(Eagle3Drafter(Eagle3Config.from_target(cfg, capture_layers=capture_layers)))
    out = engine.generate([Request(p, seq_id=i) for i, (p, _) in enumerate(batch)],
                          SamplingParams("coupled", max_new_tokens=6, seed=seed, stop_on_eos=False),
                          return_hidden=True)
    return [(p, r.tokens) for (p, _), r in zip(batch, out.results)], adv, [r.hidden_states for r in out.results]


def _case(name: str, cfg: LMConfig, policy: PolicyConfig, seed: int, shards=(), rollout: bool = False,
          capture_layers: tuple[int, ...] | None = None, offload: bool = False) -> PolicyCase:
    weights = _weights(cfg, seed)
    batch, adv = _batch(seed)
    engine_hidden = engine_features = None
    if rollout:
        batch, adv, engine_hidden = _rollout(cfg, weights, seed)
        if capture_layers is not None:
            again, _, engine_features = _rollout(cfg, weights, seed, capture_layers=capture_layers)
            assert again == batch  # the drafter only adds features; the rollout is the same
    return PolicyCase(name, cfg, weights, policy, batch, adv, shards, engine_hidden, capture_layers, engine_features,
                      offload)


CASES_1 = [_case("tp1", LLAMA, _policy(), 0, offload=True)]
CASES_2 = [
    # EAGLE-3 features: layers out of order (tp2), on both pipeline stages and repeated (pp2)
    _case("tp2", LLAMA, _policy(tp=2), 1, rollout=True, capture_layers=(1, 0)),
    _case("pp2_qwen_tied", QWEN_TIED, _policy(pp=2), 2, capture_layers=(1, 0, 1), offload=True),
    _case("dp2", LLAMA, _policy(), 3, shards=((0, 2, 4), (1, 3)), offload=True),
]
CASES = CASES_1 + CASES_2


@pytest.fixture(scope="module")
def results():
    out = launch_forked(session, 1, CASES_1, timeout_s=120)[0]
    out.update(launch_forked(session, 2, CASES_2, timeout_s=120)[0])
    return out


def _torch_policy(case: PolicyCase) -> TorchPolicy:
    config = replace(case.policy, backend="torch", tensor_parallel=1, pipeline_parallel=1, sequence_parallel=False,
                     recompute="none")
    return TorchPolicy(build_decoder(case.canonical, case.cfg), config, temperature=1.0)


def _reference(case: PolicyCase) -> dict:
    """TorchPolicy on the whole batch: log-probs, stats, updated weights and (clipped) grads."""
    trainer = _torch_policy(case)
    model = trainer.model
    old, ref = trainer.logprobs(case.batch)
    tokens = sum(len(r) for _, r in case.batch)
    stats = trainer.update(case.batch, case.advantages, old, ref, tokens)
    return {"old": old, "ref": ref, "stats": stats,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def assert_same_step(got: dict, want: dict, grads: dict, lr: float, tol: float = 1e-5) -> None:
    """Updated weights agree to `tol`, except where AdamW's first step is ill-conditioned.

    Its first step moves a weight by lr * g / (|g| + eps) (eps = 1e-8): where |g| is
    below ~1e-7 (Qwen2's k_proj bias: softmax over keys is shift-invariant, only RoPE
    leaves it a ~1e-9 gradient), float rounding of g in the 1e-9 range changes the step
    by a good fraction of lr. Those few weights only have to stay within lr.
    """
    ill_total, total = 0, sum(t.numel() for t in want.values())
    for name in want:
        diff = (got[name] - want[name]).abs()
        g = grads[name]
        ill = (g != 0) & (g.abs() < 1e-7)
        ill_total += int(ill.sum())
        assert float(torch.where(ill, 0.0, diff).max()) <= tol, name
        assert float(torch.where(ill, diff, 0.0).max()) <= lr, name
    assert ill_total <= total // 1000  # a handful of weights, so the check above still means something


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_logprobs_and_update_match_policy_trainer(results, case):
    res = results[case.name]
    want = _reference(case)
    old, ref, stats, updated = want["old"], want["ref"], want["stats"], want["weights"]
    for rank in res["ranks"]:  # every rank (every stage, every TP rank) returns the same log-probs
        for j, i in enumerate(rank["ids"]):
            torch.testing.assert_close(rank["old"][j], old[i], rtol=0, atol=2e-5)
            torch.testing.assert_close(rank["ref"][j], ref[i], rtol=0, atol=2e-5)
    if not case.shards:  # with DP each replica reports the stats of its own half
        mine = res["ranks"][0]["stats"]
        for key in ("loss", "pg_loss", "kl", "approx_kl", "grad_norm"):
            assert mine[key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
    assert stats["grad_norm"] > OPTIM.grad_clip  # clipping was active, so the norm had to be global
    canonical = res["canonical"]
    assert sorted(canonical) == sorted(updated)
    moved = max(float((updated[k] - case.canonical[k]).abs().max()) for k in updated)
    assert moved > 50 * 1e-5  # the step is large against the tolerance below: a wrong update shows
    assert_same_step(canonical, updated, want["grads"], case.policy.optim.lr)
    for rank in res["ranks"]:  # streamed to rollout TP=1 on every rank: the same weights
        assert sorted(rank["rollout"]) == sorted(canonical)
        for name, value in rank["rollout"].items():
            assert torch.equal(value, canonical[name]), name


@pytest.mark.timeout(180)
def test_data_parallel_grad_norm_and_loss_shares_match_the_full_batch(results):
    """DP=2, each replica on its half: the grad norm (taken after the data-parallel reduce,
    before clipping) is the full batch's on every replica, and the replicas' loss shares sum
    to the full batch's loss. The updated weights alone cannot show a constant scale error
    of the reduced gradient: clipping and AdamW's first step both normalise it away."""
    case = next(c for c in CASES if c.name == "dp2")
    want = _reference(case)["stats"]
    ranks = results[case.name]["ranks"]
    assert sorted(r["dp"] for r in ranks) == [0, 1]
    for rank in ranks:
        assert rank["stats"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), rank["dp"]
    for key in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl"):
        assert sum(r["stats"][key] for r in ranks) == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_on_policy_second_step_matches_policy_trainer(results, case):
    """A second step with logp_old=None (old log-probs from the loss forward itself)
    matches TorchPolicy doing the same."""
    trainer = _torch_policy(case)
    model = trainer.model
    old, ref = trainer.logprobs(case.batch)
    tokens = sum(len(r) for _, r in case.batch)
    trainer.update(case.batch, case.advantages, old, ref, tokens)
    stats = trainer.update(case.batch, case.advantages, None, ref, tokens)
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0  # ratio exactly 1
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # two AdamW steps: the second divides by sqrt(v) of two rounded gradients, so a
    # summation-order difference (DP) grows a little more than after one step
    assert_same_step(results[case.name]["canonical_on_policy"], want, grads, case.policy.optim.lr, tol=5e-5)
    moved = max(float((want[k] - case.canonical[k]).abs().max()) for k in want)
    assert moved > 20 * 5e-5


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_canonical_weights_at_rollout_tp_send_each_rank_its_slices_only(results, case):
    """``canonical_weights(rollout_tp=2)`` on 2 ranks: rank r gets exactly the rollout TP rank r
    slice of every canonical tensor (bit-exact), never the whole tensor where the layout splits it."""
    for r, rank in enumerate(results[case.name]["ranks"]):
        whole, slices = rank["rollout"], rank["rollout_slices"]
        assert list(slices) == list(whole)
        for name, tensor in whole.items():
            assert torch.equal(slices[name], rollout_slice(name, tensor, 2, r)), (r, name)
        assert sum(t.numel() for t in slices.values()) < 0.6 * sum(t.numel() for t in whole.values())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_updated_canonical_weights_load_into_decoder_lm(results, case):
    updated = _reference(case)["weights"]
    mega = DecoderLM(case.cfg)
    mega.load_state_dict(results[case.name]["canonical"])
    ref = DecoderLM(case.cfg)
    ref.load_state_dict(updated)
    ids = torch.tensor([case.batch[0][0] + case.batch[0][1]])
    with torch.no_grad():
        torch.testing.assert_close(mega.eval()(ids), ref.eval()(ids), rtol=0, atol=1e-4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hidden_capture_during_logprobs_equals_the_torch_backend_on_every_rank(results, case):
    """Every rank (every stage: broadcast from the last one under PP) gets every sequence of
    its batch, equal to what the torch backend captures from the same batch and weights."""
    torch_hidden = {}
    _torch_policy(case).logprobs(case.batch, on_hidden=lambda i, t, h: torch_hidden.__setitem__(i, (t, h)))
    for rank in results[case.name]["ranks"]:
        assert sorted(rank["hidden"]) == sorted(rank["ids"]), rank["coords"]
        for i, (tokens, hidden) in rank["hidden"].items():
            prompt, response = case.batch[i]
            assert tokens.tolist() == prompt + response == torch_hidden[i][0].tolist()
            assert hidden.dtype == torch.float32 and hidden.shape == (len(tokens), case.cfg.hidden_size)
            torch.testing.assert_close(hidden, torch_hidden[i][1], rtol=0, atol=2e-5)


@pytest.mark.timeout(180)
def test_megatron_drafter_data_equals_the_torch_engines_harvest(results):
    """The acceptance test of drafter data "for free": on a rollout of the torch engine, the
    megatron backend (TP=2) hands on_hidden the same features the engine harvested with
    return_hidden=True. The engine's rows are [prompt_len + len(tokens) - 1, H] (feature at
    t predicts t + 1; the last token is never fed); the policy's cover every token."""
    case = next(c for c in CASES if c.name == "tp2")
    assert case.engine_hidden is not None
    for rank in results[case.name]["ranks"]:
        assert sorted(rank["hidden"]) == list(range(len(case.batch)))
        for i, (tokens, hidden) in rank["hidden"].items():
            engine = case.engine_hidden[i]
            assert engine.shape == (len(tokens) - 1, case.cfg.hidden_size)
            torch.testing.assert_close(hidden[:-1], engine.float(), rtol=0, atol=5e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [c for c in CASES if c.capture_layers], ids=lambda c: c.name)
def test_eagle3_features_of_the_update_forward_equal_the_torch_backend_on_every_rank(results, case):
    """With an EAGLE-3 drafter's capture_layers the update forward hands on_hidden, on every
    rank (every stage: each layer broadcast from the stage holding it), the captured layers in
    order and then the final state: what the torch backend captures from the same weights."""
    torch_features = {}
    _torch_policy(case).logprobs(case.batch, on_hidden=lambda i, t, h: torch_features.__setitem__(i, h),
                                 capture_layers=case.capture_layers)
    width = (len(case.capture_layers) + 1) * case.cfg.hidden_size
    for rank in results[case.name]["ranks"]:
        assert sorted(rank["features"]) == sorted(rank["ids"]), rank["coords"]
        for i, (tokens, features) in rank["features"].items():
            assert tokens.tolist() == case.batch[i][0] + case.batch[i][1]
            assert features.dtype == torch.float32 and features.shape == (len(tokens), width)
            torch.testing.assert_close(features, torch_features[i], rtol=0, atol=2e-5, msg=f"{rank['coords']} {i}")
            if case.engine_features is not None:  # drafter data "for free" is the rollout's data
                engine = case.engine_features[i].float()
                assert engine.shape == (len(tokens) - 1, width)
                torch.testing.assert_close(features[:-1], engine, rtol=0, atol=5e-5, msg=f"{rank['coords']} {i}")


@pytest.mark.timeout(180)
def test_capture_layers_outside_the_model_are_refused_before_any_collective():
    """Validated first: no process group is needed to see the error (a collective would hang here)."""
    policy = MegatronPolicy.__new__(MegatronPolicy)
    policy._model_config = LLAMA
    batch, adv = _batch(4)
    with pytest.raises(ValueError, match=r"capture_layers=\(2,\).*num_layers=2"):
        policy.logprobs(batch, on_hidden=lambda *a: None, capture_layers=(2,))
    with pytest.raises(ValueError, match=r"capture_layers=\(0, -1\).*num_layers=2"):
        policy.update(batch, adv, None, None, 10, on_hidden=lambda *a: None, capture_layers=(0, -1))


@pytest.mark.timeout(180)
def test_model_parallel_ranks_train_together(results):
    """Model-parallel ranks train on one batch; the optimizer state differs per rank whenever there
    are several (split over TP x PP, and over data-parallel replicas by the distributed optimizer)."""
    for case in CASES:
        for rank in results[case.name]["ranks"]:
            sharded = case.policy.model_parallel > 1
            assert rank["sharded_state"] == (len(results[case.name]["ranks"]) > 1), case.name
            assert rank["train_ranks"] == ((0, 1) if sharded else (rank["train_ranks"][0],)), case.name
            assert "step" in rank["opt_state_keys"] and "optimizer" in rank["opt_state_keys"]


@pytest.mark.timeout(180)
def test_replicated_norms_stay_identical_across_tp(results):
    ranks = results["tp2"]["ranks"]
    assert sorted(r["coords"][1] for r in ranks) == [0, 1]
    a, b = ranks[0]["norms"], ranks[1]["norms"]
    assert a and sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: the same gradients and AdamW step


def test_bad_parallel_sizes_fail_before_any_collective():
    cfg = LLAMA
    with pytest.raises(ValueError, match=r"policy\.tensor_parallel=3.*num_heads=4"):
        MegatronPolicy({}, cfg, _policy(tp=3), temperature=1.0, seed=0)
    with pytest.raises(ValueError, match=r"policy\.tensor_parallel=4.*num_kv_heads"):
        check_policy_model(_policy(tp=4), cfg)
    with pytest.raises(ValueError, match=r"policy\.pipeline_parallel=3 exceeds num_layers=2"):
        check_policy_model(_policy(pp=3), cfg)
    with pytest.raises(RuntimeError, match=r"initialised torch.distributed world"):
        MegatronPolicy({}, cfg, _policy(), temperature=1.0, seed=0)


OFFLOADED = [c for c in CASES if c.offload]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", OFFLOADED, ids=[c.name for c in OFFLOADED])
def test_offloaded_training_state_is_released_and_the_next_update_is_bit_identical(results, case):
    """``offload_training_state`` between two steps: the DDP parameter and gradient buffers, the
    distributed optimizer's state and main params and the KL reference hold no memory until
    ``reload_training_state``, and the second step then ends bit for bit where the policy that
    never moved ends (stats, this rank's optimizer shard, the gathered weights)."""
    res = results[case.name]
    for rank in res["ranks"]:
        assert rank["offload"] == {"kept": [], "stats": True, "state": True}, rank["coords"]
    want, got = res["canonical_on_policy"], res["canonical_offloaded"]
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
