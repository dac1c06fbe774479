"""EAGLE-3 drafter: fused layer capture, training-time test equal to drafting,
reduced draft vocabulary, save/load, training raises acceptance."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.data import DrafterSample, pad_eagle_batch
from nemo_tlt.drafter.draft_vocab import most_frequent, target_to_draft, vocab_maps
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter, default_capture_layers
from nemo_tlt.drafter.io import load_drafter, save_drafter
from nemo_tlt.drafter.train import DrafterTrainConfig, drafter_loss, train_drafter
from nemo_tlt.drafter.ttt import ttt_outputs
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import tiny_config, tiny_target


def _drafter(cfg, seed=1, **kw) -> Eagle3Drafter:
    d = Eagle3Drafter(Eagle3Config.from_target(cfg, **kw), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norms, so a norm applied to the wrong input shows
        for name, p in d.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return d


def test_default_capture_layers_follow_tensorrt_llm():
    assert default_capture_layers(32) == (1, 15, 28)   # TensorRT-LLM: (1, L//2 - 1, L - 4)
    assert default_capture_layers(16) == (1, 7, 12)
    assert default_capture_layers(2) == (0, 0, 1)      # TensorRT-LLM refuses L <= 5
    assert default_capture_layers(4) == (0, 1, 3)


def test_hidden_capture_is_the_layer_outputs_of_the_same_forward():
    target = tiny_target(seed=2, num_layers=3)
    ids = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o)) for layer in target.model.layers]
    with torch.no_grad():
        hidden, captured = target.hidden_capture(ids, (2, 0, 2))
    for h in hooks:
        h.remove()
    assert len(outs) == 3  # one forward
    torch.testing.assert_close(hidden, target.hidden(ids))
    torch.testing.assert_close(captured, torch.cat([outs[2], outs[0], outs[2]], -1))
    with pytest.raises(ValueError, match="capture"):
        target.hidden_capture(ids, (3,))


def test_ttt_steps_are_what_drafting_computes():
    """Step j at chain t of training-time test equals feeding the committed prefix
    0..t, then j chain nodes, through the drafter's KV cache (as tree drafting does)."""
    target = tiny_target(seed=3, scale=5.0)
    drafter = _drafter(target.config).eval()
    ids = torch.randint(3, 32, (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target.hidden_capture(ids[None], drafter.capture_layers)[1][0, :-1]
        batch = pad_eagle_batch([DrafterSample(ids, feats)])
        outs = ttt_outputs(drafter, target, batch, batch.in_feat, 3)
        c = drafter.config.layer
        for t0 in (0, 4, 8):
            cache = KVCache(1, 1, c.num_kv_heads, 32, c.head_dim, torch.float32, torch.device("cpu"))
            n = t0 + 1
            o = drafter.feed_committed(target, batch.next_tokens[:, :n], batch.in_feat[:, :n],
                                       batch.positions[:, :n], cache, torch.ones(1, n, n, dtype=torch.bool).tril())
            cache.advance(n)
            torch.testing.assert_close(o[:, -1], outs[0][:, t0])
            prev = o[:, -1:]
            for j in (1, 2):
                prev = drafter(target, batch.next_tokens[:, t0 + j: t0 + j + 1], prev, torch.tensor([[t0 + j]]),
                               cache)
                cache.advance(1)
                torch.testing.assert_close(prev[:, 0], outs[j][:, t0], atol=1e-5, rtol=1e-5)


def test_reduced_vocab_maps_and_logits():
    ids = torch.tensor([2, 5, 6, 30])
    d2t, t2d = vocab_maps(ids, 32)
    assert d2t.tolist() == [2, 4, 4, 27] and int(t2d.sum()) == 4 and bool(t2d[ids].all())
    idx, kept = target_to_draft(t2d, torch.tensor([5, 7, 30]))
    assert idx.tolist() == [1, 0, 3] and kept.tolist() == [True, False, True]
    assert most_frequent([torch.tensor([9, 9, 4, 4, 4, 1])], 3, 32, always=(2,)).tolist() == [2, 4, 9]
    target = tiny_target(seed=3)
    drafter = _drafter(target.config, draft_vocab_size=4)
    drafter.set_draft_vocab(ids)
    out = torch.randn(2, 3, target.config.hidden_size)
    full = drafter.draft_logits(target, out)
    assert full.shape == (2, 3, 32)
    torch.testing.assert_close(full[..., ids], drafter.head(out))
    assert bool(torch.isinf(full[..., ~t2d]).all())


def test_reduced_vocab_drafts_losslessly_and_only_from_its_vocab():
    target = tiny_target(seed=3, scale=5.0)
    drafter = _drafter(target.config, draft_vocab_size=20)
    drafter.set_draft_vocab(torch.arange(6, 26))
    reqs = [Request([5, 6, 7, 8]), Request([9, 10])]
    sp = SamplingParams("greedy", max_new_tokens=20, stop_on_eos=False)
    base = TorchRolloutEngine(target).generate(reqs, sp)
    engine = TorchRolloutEngine(target, drafter)
    seen = []
    propose = drafter.propose
    drafter.propose = lambda *a: seen.append(propose(*a)) or seen[-1]
    out = engine.generate(reqs, sp, policy=FixedSDPolicy(TreeShape(3, 2, 5)))
    assert [r.tokens for r in out.results] == [r.tokens for r in base.results]
    drafted = torch.cat([tree.tokens.flatten() for tree in seen])
    assert seen and bool(((drafted >= 6) & (drafted < 26)).all())


def test_save_load_round_trip_with_reduced_vocab(tmp_path):
    target = tiny_target(seed=3)
    drafter = _drafter(target.config, capture_layers=(1, 0), draft_vocab_size=5, ttt_steps=2, ttt_decay=0.5)
    drafter.set_draft_vocab(torch.tensor([0, 3, 4, 9, 31]))
    loaded = load_drafter(save_drafter(drafter, tmp_path / "d"), target)
    assert isinstance(loaded, Eagle3Drafter) and loaded.config == drafter.config
    a, b = drafter.state_dict(), loaded.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_config_is_validated():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target(cfg, draft_vocab_size=33)
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3Config.from_target(cfg, ttt_steps=0)
    with pytest.raises(ValueError, match="capture_layers"):
        Eagle3Config.from_target(cfg, capture_layers=())
    with pytest.raises(ValueError, match="num_layers=2"):
        TorchRolloutEngine(tiny_target(), Eagle3Drafter(Eagle3Config.from_target(cfg, capture_layers=(0, 2))))


def _rollout_samples(target, drafter_like, n=24, new=40):
    """The target's greedy generations with the drafter's features (from the engine)."""
    g = torch.Generator().manual_seed(5)
    reqs = [Request(torch.randint(3, 32, (4,), generator=g).tolist()) for _ in range(n)]
    engine = TorchRolloutEngine(target, drafter_like)
    res = engine.generate(reqs, SamplingParams("greedy", max_new_tokens=new, stop_on_eos=False),
                          return_hidden=True).results
    return reqs, [DrafterSample(torch.tensor(list(r.prompt) + o.tokens), o.hidden_states) for r, o in zip(reqs, res)]


def test_training_with_ttt_raises_acceptance():
    target = tiny_target(seed=3, scale=5.0)
    drafter = _drafter(target.config, ttt_steps=3)
    reqs, samples = _rollout_samples(target, drafter)
    H = target.config.hidden_size
    assert samples[0].hidden.shape[1] == 4 * H == drafter.feature_width  # 3 captured layers, then the final state
    torch.testing.assert_close(samples[0].hidden[:, 3 * H:], target.hidden(samples[0].tokens[None, :-1])[0])
    shape, sp = TreeShape(4, 2, 8), SamplingParams("greedy", max_new_tokens=40, stop_on_eos=False)

    def accept():
        return TorchRolloutEngine(target, drafter).generate(reqs[:8], sp, policy=FixedSDPolicy(shape)).stats.mean_accept_len

    before = accept()
    batch = pad_eagle_batch(samples[:4])
    loss0, stats = drafter_loss(drafter, target, batch)
    loss0 = loss0.detach()
    assert {"ce_step0", "ce_step2", "top1"} <= set(stats)
    train_drafter(drafter, target, samples, DrafterTrainConfig(steps=150, batch_size=8, lr=3e-3, warmup_steps=5),
                  progress=False)
    loss1, stats1 = drafter_loss(drafter, target, batch)
    # soft labels: the loss is bounded below by the target's entropy; the top-1 agreement is not
    assert float(loss1) < float(loss0) and stats1["top1"] > stats["top1"] + 0.3
    assert accept() > before + 0.5


@pytest.mark.parametrize("vocab", [None, 20])
def test_ttt_loss_is_cross_entropy_against_the_targets_distribution(vocab):
    """Step j at chain t is scored against softmax(target logits at t+j+1) over the
    draft vocabulary (EAGLE-3's soft labels), masked where the target's argmax is
    outside it; not against the sampled token."""
    target = tiny_target(seed=3, scale=2.0)
    kw = {} if vocab is None else {"draft_vocab_size": vocab}
    drafter = _drafter(target.config, ttt_steps=2, ttt_decay=0.5, **kw)
    if vocab:
        drafter.set_draft_vocab(torch.arange(6, 26))
    ids = torch.randint(3, 32, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden, captured = target.hidden_capture(ids[None], drafter.capture_layers)
        batch = pad_eagle_batch([DrafterSample(ids, torch.cat((captured, hidden), -1)[0, :-1])])
        loss, stats = drafter_loss(drafter, target, batch)
        outs = ttt_outputs(drafter, target, batch, batch.in_feat, 2)
        logits_t = target.logits(hidden)[0]                          # [T, V]: distribution of token t+1
        keep = torch.arange(6, 26) if vocab else torch.arange(32)
        expected = 0.0
        n = batch.next_tokens.shape[1]
        for j in range(2):
            ces = []
            for t in range(n - j):                                      # label x[t+j+2] from the state at t+j+1
                row = logits_t[t + j + 1]
                if vocab and not 6 <= int(row.argmax()) < 26:
                    continue
                p = row[keep].softmax(-1)
                q = drafter.head(outs[j][0, t]).log_softmax(-1)
                ces.append(-(p * q).sum())
            expected += 0.5 ** j * torch.stack(ces).mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs 128"):
        drafter_loss(drafter, target, pad_eagle_batch([DrafterSample(ids, captured[0, :-1])]))


def test_engine_checks_the_tree_against_the_drafter(caplog):
    """A tree wider than the draft vocabulary is refused by name before it drafts; one
    deeper than the training-time test is drafted, with one warning per depth."""
    target = tiny_target(seed=3, scale=5.0)
    drafter = _drafter(target.config, draft_vocab_size=4, ttt_steps=2)
    engine = TorchRolloutEngine(target, drafter)
    sp = SamplingParams("greedy", max_new_tokens=8, stop_on_eos=False)
    with pytest.raises(ValueError, match="topk=5 exceeds the draft vocabulary size 4"):
        engine.generate([Request([5, 6, 7])], sp, policy=FixedSDPolicy(TreeShape(3, 5, 6)))
    with caplog.at_level("WARNING", logger="nemo_tlt.drafter.eagle3"):
        engine.generate([Request([5, 6, 7])], sp, policy=FixedSDPolicy(TreeShape(2, 2, 3)))
        assert not caplog.records
        engine.generate([Request([5, 6, 7])], sp, policy=FixedSDPolicy(TreeShape(4, 2, 6)))
        engine.generate([Request([5, 6, 7])], sp, policy=FixedSDPolicy(TreeShape(4, 2, 6)))
    assert len(caplog.records) == 1 and "ttt_steps=2" in caplog.records[0].getMessage()
