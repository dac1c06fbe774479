"""SFT warm start: example encoding, LR schedule, a tiny model learns, the cache is reused."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.demo import sft as sft_module
from nemo_tlt.demo.sft import (
    SFTConfig, accumulate_batch_grad, cached_warm_start, collate, encode_example, length_buckets, lr_at,
    sft_loss, train_sft,
)
from nemo_tlt.demo.tasks import Problem, TaskConfig, make_problems
from nemo_tlt.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

TINY = LMConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine run fastest (and least noisily) on one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _seeded_model(seed=0):
    model = DecoderLM(TINY)
    model.init_weights_(torch.Generator().manual_seed(seed))
    return model


def test_encode_example_masks_the_prompt():
    tok = CharTokenizer()
    ids, mask = encode_example(Problem("arith", "1+2=", "1+2=3#3", "3", 1), tok)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert tok.decode(ids) == "1+2=1+2=3#3"
    assert mask == [0] * 5 + [1] * 8  # BOS + 4 prompt chars masked; 7 solution chars + EOS learned
    assert encode_example(([7, 8], [9]), tok) == ([BOS_ID, 7, 8, 9, EOS_ID], [0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="both"):
        encode_example(("1+2=", [4]), tok)


def test_collate_shifts_and_pads():
    inputs, targets, weights = collate([([1, 5, 6, 2], [0, 0, 1, 1]), ([1, 7, 2], [0, 1, 1])], PAD_ID)
    assert inputs.tolist() == [[1, 5, 6], [1, 7, 2]]
    assert targets.tolist() == [[5, 6, 2], [7, 2, 0]]
    assert weights.tolist() == [[0, 1, 1], [1, 1, 0]]


def test_sft_loss_is_token_mean_over_weighted_targets():
    model = _seeded_model()
    inputs, targets, weights = collate([([1, 5, 6, 2], [0, 0, 1, 1]), ([1, 7, 2], [0, 1, 1])], PAD_ID)
    logits = model(inputs)
    ce = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), reduction="none").reshape(2, 3)
    expected = (ce[0, 1] + ce[0, 2] + ce[1, 0] + ce[1, 1]) / 4
    assert sft_loss(model, inputs, targets, weights).item() == pytest.approx(expected.item(), rel=1e-5)


def test_length_buckets():
    lengths = [5, 30, 6, 7, 29, 100]
    groups = length_buckets(lengths, max_tokens=60)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups == [[0, 2, 3], [4, 1], [5]]  # sorted by length; 100 > 60 stands alone
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 60


def test_micro_batches_give_the_full_batch_gradient():
    tok = CharTokenizer()
    problems = make_problems(TaskConfig(name="sort", max_steps=10), 12, np.random.default_rng(2))
    batch = [encode_example(p, tok) for p in problems]
    model = _seeded_model()
    loss_split, n_split = accumulate_batch_grad(model, batch, PAD_ID, micro_batch_tokens=64)
    grads_split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert len(length_buckets([len(ids) for ids, _ in batch], 64)) > 2
    inputs, targets, weights = collate(batch, PAD_ID)
    full = sft_loss(model, inputs, targets, weights)
    full.backward()
    assert n_split == int(weights.sum()) and loss_split == pytest.approx(full.item(), rel=1e-5)
    for a, p in zip(grads_split, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7)


def test_lr_schedule():
    cfg = SFTConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(109, cfg) == pytest.approx(1e-4)
    mid = 10 + 99 / 2
    assert lr_at(int(mid), cfg) < 1e-3 and lr_at(int(mid), cfg) == pytest.approx(
        1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 99)))
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("kwargs, field", [
    ({"steps": 0}, "steps"), ({"batch_size": 0}, "batch_size"), ({"lr": 0.0}, "lr"),
    ({"warmup_steps": 500}, "warmup_steps"), ({"weight_decay": -1.0}, "weight_decay"),
    ({"grad_clip": 0.0}, "grad_clip"), ({"seq_len": 0}, "seq_len"), ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
    ({"adam_beta2": 1.0}, "adam_beta2"), ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SFTConfig.{field}"):
        SFTConfig(**kwargs)


def test_tiny_model_learns_the_arith_task():
    tok = CharTokenizer()
    problems = make_problems(TaskConfig(name="arith", max_steps=12), 1000, np.random.default_rng(0))
    model = _seeded_model()
    cfg = SFTConfig(steps=100, batch_size=16, lr=3e-3, warmup_steps=10, seq_len=512, seed=0)
    stats = train_sft(model, problems, cfg, tok, log_every=25, progress=False)
    assert len(stats["losses"]) == 100 and stats["tokens"] > 0
    assert stats["initial_loss"] == pytest.approx(math.log(64), abs=0.3)  # near-uniform at init
    assert stats["final_loss"] < 0.6 * stats["initial_loss"]
    assert [entry["step"] for entry in stats["log"]] == [0, 25, 50, 75, 99]


def test_training_is_reproducible_from_the_seed():
    tok = CharTokenizer()
    problems = make_problems(TaskConfig(name="count", max_steps=10), 50, np.random.default_rng(0))
    cfg = SFTConfig(steps=4, batch_size=4, warmup_steps=1, seed=3)
    a = train_sft(_seeded_model(1), problems, cfg, tok, progress=False)["losses"]
    b = train_sft(_seeded_model(1), problems, cfg, tok, progress=False)["losses"]
    c = train_sft(_seeded_model(1), problems, SFTConfig(steps=4, batch_size=4, warmup_steps=1, seed=4),
                  tok, progress=False)["losses"]
    assert a == b and a != c


def test_too_long_example_fails_loudly():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="seq_len"):
        train_sft(_seeded_model(), [("1+1=", "2" * 40)], SFTConfig(steps=1, seq_len=16, warmup_steps=0), tok,
                  progress=False)


def test_cached_warm_start_trains_once(tmp_path, monkeypatch):
    from nemo_tlt.model.hf_io import load_hf_folder

    task = TaskConfig(name="arith", max_steps=8, max_solution_chars=100)
    cfg = SFTConfig(steps=3, batch_size=4, warmup_steps=1, seq_len=128)
    calls = []
    real_train = sft_module.train_sft
    monkeypatch.setattr(sft_module, "train_sft", lambda *a, **k: calls.append(1) or real_train(*a, **k))
    first = cached_warm_start(tmp_path, TINY, task, cfg, num_examples=32, progress=False)
    assert calls == [1]
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    meta = json.loads((first / "warm_start.json").read_text())
    assert meta["task"]["max_steps"] == 8 and meta["sft"]["steps"] == 3 and meta["num_examples"] == 32
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary folder left behind
    weights = load_hf_folder(first).state_dict()

    second = cached_warm_start(tmp_path, TINY, task, cfg, num_examples=32, progress=False)
    assert second == first and calls == [1]  # reused: no training
    assert all(torch.equal(v, load_hf_folder(second).state_dict()[k]) for k, v in weights.items())

    third = cached_warm_start(tmp_path, TINY, task, SFTConfig(steps=3, batch_size=4, warmup_steps=1, seq_len=128,
                                                               seed=1), num_examples=32, progress=False)
    assert third != first and calls == [1, 1]


def test_cached_warm_start_checks_the_context_fits(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        cached_warm_start(tmp_path, TINY, TaskConfig(name="arith"), SFTConfig(seq_len=128), progress=False)
    small_vocab = LMConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                           num_kv_heads=2)
    with pytest.raises(ValueError, match="vocab_size"):
        cached_warm_start(tmp_path, small_vocab, TaskConfig(name="arith"), SFTConfig(), progress=False)
    assert list(tmp_path.iterdir()) == []
