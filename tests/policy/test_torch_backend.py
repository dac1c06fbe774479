"""TorchPolicy: one optimizer step per batch, so the old log-probs may come from the
update's own forward (logp_old=None) instead of a separate pass; data parallelism sums
the gradients inside the backend; the captured hidden states are DecoderLM.hidden's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ranks import launch_forked
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.optim import OptimConfig
from nemo_tlt.policy import PolicyBackend, PolicyConfig, PolicyOptimConfig, build_policy_backend
from nemo_tlt.policy.torch_backend import TorchPolicy, build_decoder
from tiny import tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from torch_dp_workers import data_parallel_update, update_with_grads  # noqa: E402


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = [(torch.randint(3, 32, (int(p),), generator=g).tolist(), torch.randint(3, 32, (int(r),), generator=g).tolist())
             for p, r in zip(torch.randint(2, 6, (6,), generator=g), torch.randint(1, 12, (6,), generator=g))]
    return batch, torch.randn(6, generator=g)


def _trainer(kl_coef: float = 0.0, optim: OptimConfig = PolicyOptimConfig(lr=1e-3)) -> TorchPolicy:
    model = DecoderLM(tiny_config()).init_weights_(torch.Generator().manual_seed(0))
    return TorchPolicy(model, PolicyConfig(micro_batch=4, kl_coef=kl_coef, optim=optim), temperature=0.8)


def test_update_without_a_logprob_pass_matches_the_separate_pass():
    batch, adv = _batch(1)
    tokens = sum(len(r) for _, r in batch)
    a, b = _trainer(kl_coef=0.05), _trainer(kl_coef=0.05)
    old, ref = a.logprobs(batch)
    sa = a.update(batch, adv, old, ref, tokens)
    none_old, ref_b = b.logprobs(batch, current=False)
    assert none_old is None and ref_b is not None
    sb = b.update(batch, adv, None, ref_b, tokens)
    assert sb["clip_frac"] == 0.0 and sb["approx_kl"] == 0.0
    for key in ("loss", "pg_loss", "kl", "grad_norm"):
        assert abs(sa[key] - sb[key]) <= 1e-5 * max(1.0, abs(sa[key])), key
    moved = 0.0
    for (name, pa), pb, p0 in zip(a.model.named_parameters(), b.model.parameters(), _trainer().model.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((pa - p0).abs().max()))
    assert moved > 1e-4  # the step is far larger than the tolerance


def test_no_reference_and_no_current_pass_returns_nothing():
    batch, _ = _batch(2)
    assert _trainer().logprobs(batch, current=False) == (None, None)


@pytest.mark.timeout(180)
def test_data_parallel_gradient_is_the_full_batch_gradient():
    """Two replicas, each on half the batch, with the RL loop's gradient all-reduce, against
    one replica on the whole batch: the gradients clipping sees (and so the grad norm) must
    agree, not only the AdamW step, which is blind to a constant scale of the gradient."""
    batch, adv = _batch(3)
    cfg = tiny_config()
    weights = DecoderLM(cfg).init_weights_(torch.Generator().manual_seed(3)).state_dict()
    policy = PolicyConfig(micro_batch=2, kl_coef=0.05, optim=PolicyOptimConfig(lr=1e-3, grad_clip=0.5))
    want = update_with_grads(TorchPolicy(build_decoder(weights, cfg), policy, temperature=1.0), batch, adv,
                             sum(len(r) for _, r in batch))
    shards = ((0, 2, 4), (1, 3, 5))
    ranks = launch_forked(data_parallel_update, 2, cfg, weights, policy, batch, adv, shards, timeout_s=120)
    assert want["stats"]["grad_norm"] > policy.optim.grad_clip  # clipping is active: the norm must be global
    for got in ranks:
        assert got["stats"]["grad_norm"] == pytest.approx(want["stats"]["grad_norm"], rel=1e-5)
        for name, g in want["grads"].items():  # reduced, then clipped by the global norm
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-5, msg=name)
    # each replica's loss is its share of the global token mean: the shares sum to the whole
    for key in ("loss", "pg_loss", "kl"):
        assert sum(r["stats"][key] for r in ranks) == pytest.approx(want["stats"][key], rel=1e-5, abs=1e-7), key


def test_hidden_states_are_decoder_lm_hidden_of_the_logprob_and_update_forwards():
    batch, adv = _batch(4)
    policy = _trainer()
    with torch.no_grad():
        want = {i: policy.model.hidden(torch.tensor([p + r]))[0] for i, (p, r) in enumerate(batch)}
    for call in ("logprobs", "update"):
        seen = {}
        sink = lambda i, tokens, hidden: seen.__setitem__(i, (tokens, hidden))  # noqa: E731
        if call == "logprobs":
            policy.logprobs(batch, on_hidden=sink)
        else:
            policy.update(batch, adv, None, None, sum(len(r) for _, r in batch), on_hidden=sink)
        assert sorted(seen) == list(range(len(batch))), call
        for i, (tokens, hidden) in seen.items():
            assert tokens.tolist() == batch[i][0] + batch[i][1]
            assert hidden.dtype == torch.float32 and not hidden.requires_grad
            torch.testing.assert_close(hidden, want[i], rtol=0, atol=1e-6)


def test_schedule_warmup_reaches_the_optimizer_and_resumes_with_its_step():
    batch, adv = _batch(5)
    tokens = sum(len(r) for _, r in batch)
    policy = _trainer(optim=PolicyOptimConfig(lr=1e-3, warmup_steps=4))
    lrs = [policy.update(batch, adv, None, None, tokens)["lr"] for _ in range(2)]
    assert lrs == [2.5e-4, 5e-4]
    again = _trainer(optim=PolicyOptimConfig(lr=1e-3, warmup_steps=4))
    again.load_state_dict(policy.state_dict())
    assert again.update(batch, adv, None, None, tokens)["lr"] == 7.5e-4


def test_factory_builds_a_torch_backend_without_a_process_group_and_leaves_the_rng_alone():
    cfg = tiny_config()
    weights = DecoderLM(cfg).init_weights_(torch.Generator().manual_seed(6)).state_dict()
    state = torch.random.get_rng_state()
    backend = build_policy_backend(PolicyConfig(), weights, cfg, temperature=1.0, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert isinstance(backend, PolicyBackend) and isinstance(backend, TorchPolicy)
    assert backend.train_ranks == (0,) and not backend.sharded_state and backend.captures_hidden
    streamed = dict(backend.canonical_weights())
    assert sorted(streamed) == sorted(weights) and all(torch.equal(streamed[k], weights[k]) for k in weights)
    assert streamed["model.norm.weight"].data_ptr() != weights["model.norm.weight"].data_ptr()  # a copy


def test_policy_config_errors_name_the_yaml_key():
    with pytest.raises(ValueError, match=r"policy\.optim\.lr must be > 0, got 0\.0"):
        PolicyConfig(optim=PolicyOptimConfig(lr=0.0))
    with pytest.raises(ValueError, match=r"policy\.tensor_parallel / policy\.pipeline_parallel > 1 need "
                                         r"policy\.backend=megatron"):
        PolicyConfig(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"policy\.backend must be one of"):
        PolicyConfig(backend="jax")


CAPTURE = (2, 0, 2)  # out of order and repeated: the features follow the drafter's order


def _layer_outputs(model: DecoderLM, ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Every decoder layer's output (forward hooks, not hidden_capture's taps) and the final state."""
    outs: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: outs.__setitem__(i, out))
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            return outs, model.hidden(ids)
    finally:
        for h in handles:
            h.remove()


def test_eagle3_features_are_the_captured_layers_then_the_final_state_of_the_same_forward():
    """With capture_layers, on_hidden gets [L, (k + 1) * H]: those layers' outputs (before the
    final norm) in the drafter's order, then the final hidden state, from the log-prob and
    from the update forward; and the same features the torch rollout engine keeps for an
    EAGLE-3 drafter with those layers."""
    from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
    from nemo_tlt.rollout.protocol import Request
    from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
    from nemo_tlt.speculative.sampling import SamplingParams

    cfg = tiny_config(num_layers=3)
    weights = DecoderLM(cfg).init_weights_(torch.Generator().manual_seed(7)).state_dict()
    prompts, adv = _batch(8)
    engine = TorchRolloutEngine(build_decoder(weights, cfg).eval())
    engine.load_drafter(Eagle3Drafter(Eagle3Config.from_target(cfg, capture_layers=CAPTURE)))
    out = engine.generate([Request(p, seq_id=i) for i, (p, _) in enumerate(prompts)],
                          SamplingParams("coupled", max_new_tokens=7, seed=8, stop_on_eos=False), return_hidden=True)
    batch = [(p, r.tokens) for (p, _), r in zip(prompts, out.results)]
    H = cfg.hidden_size
    want = {}
    for i, (p, r) in enumerate(batch):
        outs, final = _layer_outputs(build_decoder(weights, cfg), torch.tensor([p + r]))
        want[i] = torch.cat([outs[j] for j in CAPTURE] + [final], -1)[0]
    for call in ("logprobs", "update"):
        policy = TorchPolicy(build_decoder(weights, cfg), PolicyConfig(micro_batch=4), temperature=0.8)
        seen = {}
        sink = lambda i, tokens, hidden: seen.__setitem__(i, (tokens, hidden))  # noqa: E731
        if call == "logprobs":
            policy.logprobs(batch, on_hidden=sink, capture_layers=CAPTURE)
        else:
            policy.update(batch, adv, None, None, sum(len(r) for _, r in batch), on_hidden=sink,
                          capture_layers=CAPTURE)
        assert sorted(seen) == list(range(len(batch))), call
        for i, (tokens, features) in seen.items():
            assert tokens.tolist() == batch[i][0] + batch[i][1]
            assert features.shape == (len(tokens), (len(CAPTURE) + 1) * H)
            assert features.dtype == torch.float32 and not features.requires_grad
            torch.testing.assert_close(features, want[i], rtol=0, atol=1e-6, msg=f"{call} {i}")
            # the engine's rows cover every fed token (the last is never fed); prefill and
            # decode steps through the KV cache round differently from one full forward
            engine_features = out.results[i].hidden_states.float()
            assert engine_features.shape == (len(tokens) - 1, features.shape[1])
            torch.testing.assert_close(features[:-1], engine_features, rtol=0, atol=5e-5, msg=f"{call} {i}")


@pytest.mark.parametrize("layers", [(), (0, 3), (-1,)])
def test_capture_layers_outside_the_model_are_refused(layers):
    policy = TorchPolicy(DecoderLM(tiny_config(num_layers=3)), PolicyConfig(), temperature=1.0)
    batch, adv = _batch(9)
    sink = lambda i, tokens, hidden: None  # noqa: E731
    with pytest.raises(ValueError, match=r"capture_layers=.*num_layers=3"):
        policy.logprobs(batch, on_hidden=sink, capture_layers=layers)
    with pytest.raises(ValueError, match=r"capture_layers=.*num_layers=3"):
        policy.update(batch, adv, None, None, 10, on_hidden=sink, capture_layers=layers)
