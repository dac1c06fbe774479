"""Drafter save/load, shared (never copied) target weights, trainable size, training lowers loss."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.drafter.data import DrafterSample, pad_eagle_batch
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.io import load_drafter, save_drafter
from nemo_tlt.drafter.medusa import MedusaConfig, MedusaDrafter
from nemo_tlt.drafter.train import DrafterTrainConfig, drafter_loss, train_drafter
from tiny import tiny_config


def _samples(target, n=6, length=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 32, (length,), generator=g)
        with torch.no_grad():
            h = target.hidden(ids[None])[0, :-1]
        out.append(DrafterSample(ids, h))
    return out


@pytest.mark.parametrize("make", [lambda c: EagleDrafter(EagleConfig.from_target(c)),
                                  lambda c: MedusaDrafter(MedusaConfig(c.hidden_size, c.vocab_size, 3))])
def test_save_load_round_trip(tmp_path, target, make):
    drafter = make(target.config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    loaded = load_drafter(save_drafter(drafter, tmp_path / "d"), target)
    for (n1, a), (n2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


def test_mismatched_drafter_is_refused(tmp_path, target):
    other = EagleDrafter(EagleConfig.from_target(tiny_config(hidden_size=48, num_heads=4)))
    path = save_drafter(other, tmp_path / "d")
    with pytest.raises(ValueError, match="hidden_size=48"):
        load_drafter(path, target)


def test_eagle_shares_embedding_and_head(target):
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    per_layer = sum(p.numel() for p in target.model.layers[0].parameters())
    trainable = sum(p.numel() for p in drafter.parameters())
    assert per_layer <= trainable <= 2 * per_layer  # one decoder layer plus the fc


def test_training_does_not_touch_target_and_lowers_loss(target):
    samples = _samples(target)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    batch = pad_eagle_batch(samples)
    loss0, _ = drafter_loss(drafter, target, batch)
    train_drafter(drafter, target, samples, DrafterTrainConfig(steps=60, batch_size=6, warmup_steps=5),
                  progress=False)
    loss1, _ = drafter_loss(drafter, target, batch)
    assert float(loss1) < 0.7 * float(loss0)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in target.parameters())


def test_sample_shape_errors():
    with pytest.raises(ValueError, match="len\\(tokens\\) - 1"):
        DrafterSample(torch.zeros(5, dtype=torch.long), torch.zeros(5, 8))


def test_drafter_kinds_are_a_registry_and_errors_name_the_file(tmp_path, target):
    from nemo_tlt.drafter.kinds import DRAFTER_KINDS, EAGLE3, kind_of
    from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter

    assert DRAFTER_KINDS.names() == ("eagle", "eagle3", "medusa")
    assert kind_of(Eagle3Drafter(Eagle3Config.from_target(target.config))) is EAGLE3
    folder = save_drafter(EagleDrafter(EagleConfig.from_target(target.config)), tmp_path / "d")
    (folder / "drafter.json").write_text('{"kind": "eagle4"}')
    with pytest.raises(ValueError, match=r"drafter.json: drafter kind must be one of \['eagle', 'eagle3', 'medusa'\]"):
        load_drafter(folder)
    with pytest.raises(ValueError, match="has no `kind` naming a drafter kind"):
        kind_of(torch.nn.Linear(2, 2))
