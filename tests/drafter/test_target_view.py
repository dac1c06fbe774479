"""TargetView: a drafter trained against the view gets the same loss and gradients as
against the full target, and the view follows weight updates."""
import pytest
import torch

from nemo_tlt.drafter.data import pad_eagle_batch
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.drafter.train import drafter_loss
from nemo_tlt.drafter.data import DrafterSample
from tiny import tiny_target


def _batch(target, n=3, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        tokens = torch.randint(0, target.config.vocab_size, (length,), generator=g)
        with torch.no_grad():
            hidden = target.hidden(tokens[None])[0]
        samples.append(DrafterSample(tokens, hidden[:-1]))
    return pad_eagle_batch(samples)


@pytest.mark.parametrize("tie", [True, False])
def test_view_gives_the_targets_drafter_loss_and_grads(tie):
    target = tiny_target(tie_word_embeddings=tie)
    view = TargetView(target.config).load(target.state_dict())
    assert len(view.model.layers) == 0 and sum(p.numel() for p in view.parameters()) < \
        sum(p.numel() for p in target.parameters())
    batch = _batch(target)
    losses, grads = [], []
    for t in (target, view):
        torch.manual_seed(1)
        drafter = EagleDrafter(EagleConfig.from_target(t.config))
        loss, _ = drafter_loss(drafter, t, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in drafter.parameters() if p.grad is not None])
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_view_follows_updates_and_refuses_incomplete_or_misshapen_weights():
    target = tiny_target()
    view = TargetView(target.config).load(target.state_dict())
    new = torch.randn_like(target.model.embed_tokens.weight)
    view.update("model.embed_tokens.weight", new)
    view.update("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))  # not the view's: ignored
    assert torch.equal(view.model.embed_tokens.weight, new)
    with pytest.raises(ValueError, match="model.norm.weight"):
        TargetView(target.config).load({"model.embed_tokens.weight": new})
    with pytest.raises(ValueError, match="model.embed_tokens.weight has shape"):
        view.update("model.embed_tokens.weight", torch.zeros(2, 2))
