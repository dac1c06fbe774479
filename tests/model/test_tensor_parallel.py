"""Tensor-parallel DecoderLM on two CPU ranks (gloo): each rank holds its slices of the
whole model's weights (the rollout layout) and returns the whole model's logits, also
through a KV cache, for a Llama GQA config and a Qwen2 one (q/k/v biases, tied
embeddings), both with a vocabulary that does not split evenly."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ranks import launch_forked
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.model.tp_layout import rollout_slice
from tiny import tiny_config, tiny_target

# fp32: the ranks' partial sums add in another order than one matmul does (seen: 1e-6 on logits of
# magnitude 2.4)
ATOL = 1e-5
CASES = {
    "llama_gqa": dict(vocab_size=33, num_heads=4, num_kv_heads=2),
    "qwen2_tied": dict(family="qwen2", vocab_size=35, num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
}


def tp_model(full: DecoderLM, tp: TensorParallel) -> DecoderLM:
    """This rank's TP model holding its slices of `full`'s weights."""
    model = DecoderLM(full.config, tp)
    model.load_state_dict({k: rollout_slice(k, v, tp.size, tp.rank) for k, v in full.state_dict().items()})
    return model.eval()


def _compare(ctx) -> dict:
    tp = TensorParallel.of_group(dist.group.WORLD)
    out = {}
    ids = torch.randint(0, 33, (3, 9), generator=torch.Generator().manual_seed(1))
    for name, kw in CASES.items():
        full = tiny_target(seed=3, **kw)
        model = tp_model(full, tp)
        with torch.no_grad():
            whole = model(ids)
            cache, ref_cache = model.new_cache(3, 16), full.new_cache(3, 16)
            model.hidden(ids[:, :8], cache=cache)
            full.hidden(ids[:, :8], cache=ref_cache)
            cache.advance(8), ref_cache.advance(8)
            step = model(ids[:, 8:], cache=cache)
            ref_step = full(ids[:, 8:], cache=ref_cache)
            emb = model.model.embed_tokens(ids)
        out[name] = dict(
            logits_err=(whole - full(ids)).abs().max().item(), shape=tuple(whole.shape),
            step_err=(step - ref_step).abs().max().item(),
            embed_equal=torch.equal(emb, full.model.embed_tokens(ids)),
            local_numel=sum(p.numel() for p in model.parameters()),
            full_numel=sum(p.numel() for p in full.parameters()), kv_heads=cache.k[0].shape[1],
            keys=sorted(model.state_dict()) == sorted(full.state_dict()), logits=whole)
    try:
        DecoderLM(tiny_config(qkv_bias=True), tp)
    except ValueError as err:
        out["o_proj_bias"] = str(err)
    return out


@pytest.mark.timeout(180)
def test_tp2_logits_equal_the_whole_model():
    ranks = launch_forked(_compare, 2, timeout_s=120)
    for name, kw in CASES.items():
        vocab = kw["vocab_size"]
        for rank in ranks:
            r = rank[name]
            assert r["shape"] == (3, 9, vocab) and r["keys"]
            assert r["logits_err"] < ATOL and r["step_err"] < ATOL, (name, r["logits_err"], r["step_err"])
            assert r["embed_equal"]  # one rank adds the row, the others zeros: exact
            assert r["kv_heads"] == 1  # 2 kv heads over 2 ranks
        # every rank returns the same logits, bit for bit
        assert torch.equal(ranks[0][name]["logits"], ranks[1][name]["logits"])
        # the split weights are shared out; only the norms are held twice
        norms = (2 * 2 + 1) * 32
        assert ranks[0][name]["local_numel"] + ranks[1][name]["local_numel"] == ranks[0][name]["full_numel"] + norms
    assert "o_proj.bias" in ranks[0]["o_proj_bias"] and "tensor parallel size 2" in ranks[0]["o_proj_bias"]


def test_tensor_parallel_config_is_checked():
    assert TensorParallel().size == 1
    with pytest.raises(ValueError, match="TensorParallel.group is None but size=2"):
        TensorParallel(None, 0, 2)
    with pytest.raises(ValueError, match=r"TensorParallel.rank=2 must be < size=2"):
        TensorParallel(None, 2, 2)
    with pytest.raises(ValueError, match="TensorParallel.size must be an int >= 1"):
        TensorParallel(None, 0, 0)


def test_size_one_is_the_plain_model():
    torch.manual_seed(0)
    plain = DecoderLM(tiny_config())
    torch.manual_seed(0)
    one = DecoderLM(tiny_config(), TensorParallel())
    assert one.tp is None and type(one.model.embed_tokens) is torch.nn.Embedding
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        assert torch.equal(plain(ids), one(ids))
