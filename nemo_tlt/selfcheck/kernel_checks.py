"""The embedded engine's target at a realistic size on one device: which attention kernels
run, what a decode step costs against the memory roofline, and how close verification and
batching stay to plain one-row decoding.

Every check builds a randomly initialised model of an ``LMConfig`` (``QWEN25_7B``: Qwen2.5-7B's
shape, no weights downloaded) directly on the device in the served dtype, and returns plain
values:

* ``sdpa_probe``: the ``aten`` scaled-dot-product kernels the profiler sees in the target's
  prefill (a fresh cache), plain decode (one token against the cache) and tree verification
  (a branching tree's block against the cache), on a one-layer model of the config's
  attention shape;
* ``decode_cost``: per batch size, ms per plain decode step (greedy, EOS ignored: the time of
  ``max_new_tokens`` steps less that of ``warm_tokens`` steps, so prefill drops out), peak
  memory on CUDA, and the roofline: the bytes a step must read (weights plus the mean KV
  cache) over the device's measured copy bandwidth;
* ``verify_vs_decode``: the largest logit difference between decoding a chain token by token
  and verifying it as one block (the same tokens, positions and cache);
* ``batch_invariance``: the largest logit difference between one prompt alone and the same
  prompt as row 0 of a batch, prefill and decode;
* ``weight_sync``: a full canonical weight stream into the engine (``load_policy_weights``),
  seconds and GB/s.

Differences are recorded, never asserted: in bf16 on random weights they measure the
arithmetic, not a bug (identity is asserted on the trained demo models, ``engine_check``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree import DraftTree, tree_block_mask

# Qwen2.5-7B's shape (its config.json), randomly initialised.
QWEN25_7B = LMConfig(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                     num_heads=28, num_kv_heads=4, rope_theta=1_000_000.0, max_position_embeddings=32768,
                     bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; the CPU computes in order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_target(config: LMConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> DecoderLM:
    """``config``'s model built on ``device`` in ``dtype`` (never in fp32 or on the host) with
    N(0, 0.02) weights from a seeded generator on that device; its buffers cast as
    ``load_hf_folder`` casts them."""
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = DecoderLM(config)
    finally:
        torch.set_default_dtype(before)
    model.init_weights_(torch.Generator(device=device).manual_seed(seed))
    return model.to(dtype).eval()


def random_prompts(config: LMConfig, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] long on the host: ids above the special tokens."""
    low = 3 + max(config.bos_token_id, config.eos_token_id, config.pad_token_id)
    low = low if low < config.vocab_size // 2 else 3
    return torch.randint(low, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _sdpa_kernels(fn) -> list[str]:
    """The distinct aten scaled-dot-product ops ``fn()`` runs, as the profiler names them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events() if "scaled_dot_product" in e.name or "_attention" in e.name}
    return sorted(n for n in names if n != "aten::scaled_dot_product_attention")


def _branching_tree(batch: int, tokens: torch.Tensor) -> DraftTree:
    """Two chains under the root, [B, 2 * d] nodes: 1..d, then d+1..2d (parents as block indices)."""
    n = tokens.shape[1]
    d = n // 2
    parents = [0] + list(range(1, d)) + [0] + list(range(d + 1, n))
    depths = list(range(1, d + 1)) + list(range(1, n - d + 1))
    dev = tokens.device
    as_rows = lambda v: torch.tensor(v, device=dev).expand(batch, n).clone()  # noqa: E731
    return DraftTree(tokens, as_rows(parents), as_rows(depths), torch.zeros(batch, n, device=dev))


@torch.no_grad()
def sdpa_probe(config: LMConfig, device: torch.device, dtype: torch.dtype, prompt_len: int,
               batch: int = 1, tree_nodes: int = 8) -> dict[str, list[str]]:
    model = random_target(dataclasses.replace(config, num_layers=1), device, dtype)
    prompts = random_prompts(config, batch, prompt_len).to(device)
    cache = model.new_cache(batch, prompt_len + 1 + tree_nodes + 1)
    out = {"prefill": _sdpa_kernels(lambda: model.hidden(prompts, cache=cache))}
    cache.advance(prompt_len)
    out["decode"] = _sdpa_kernels(lambda: model.hidden(prompts[:, -1:], cache=cache))
    cache.advance(1)
    tree = _branching_tree(batch, prompts[:, :tree_nodes])
    block = torch.cat((prompts[:, -1:], tree.tokens), 1)  # the root, then the nodes
    positions = cache.lengths[:, None] + torch.cat((torch.zeros(batch, 1, dtype=torch.long, device=device),
                                                    tree.depths), 1)
    out["verify"] = _sdpa_kernels(lambda: model.hidden(block, positions, cache, tree_block_mask(tree)))
    return out


def copy_bandwidth(device: torch.device, gib: float, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy of ``gib`` GiB (read + write), best of
    ``repeats``."""
    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)
    src.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def _timed_generate(engine: TorchRolloutEngine, prompts: torch.Tensor, new_tokens: int) -> float:
    sp = SamplingParams("greedy", max_new_tokens=new_tokens, stop_on_eos=False)
    requests = [Request(p, seq_id=i) for i, p in enumerate(prompts.tolist())]
    sync(engine.device)
    t0 = time.perf_counter()
    engine.generate(requests, sp)
    sync(engine.device)
    return time.perf_counter() - t0


@torch.no_grad()
def decode_cost(config: LMConfig, device: torch.device, dtype: torch.dtype, batch_sizes: tuple[int, ...],
                prompt_len: int, max_new_tokens: int, warm_tokens: int, bandwidth_gib: float) -> dict[str, Any]:
    """See the module docstring; one untimed warm-up generate per batch size."""
    engine = TorchRolloutEngine(random_target(config, device, dtype))
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.target.state_dict().values())
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    bandwidth = copy_bandwidth(device, bandwidth_gib)
    rows = []
    for i, batch in enumerate(batch_sizes):
        prompts = random_prompts(config, batch, prompt_len, seed=i)
        _timed_generate(engine, prompts, warm_tokens)  # warm-up: allocator, kernels
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        short = _timed_generate(engine, prompts, warm_tokens)
        full = _timed_generate(engine, prompts, max_new_tokens)
        step_s = (full - short) / (max_new_tokens - warm_tokens)
        mean_context = prompt_len + (warm_tokens + max_new_tokens) / 2
        step_bytes = weight_bytes + batch * mean_context * kv_per_token
        rows.append({"batch": batch, "ms_per_step": 1e3 * step_s, "tokens_per_s": batch / step_s,
                     "roofline_ms": 1e3 * step_bytes / bandwidth, "of_roofline": step_bytes / bandwidth / step_s,
                     "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                         if device.type == "cuda" else None)})
    return {"config": f"{config.num_layers}L x {config.hidden_size}H", "dtype": str(dtype).removeprefix("torch."),
            "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "weight_gib": weight_bytes / 2**30,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "batches": rows}


@torch.no_grad()
def verify_vs_decode(config: LMConfig, device: torch.device, dtype: torch.dtype, prompt_len: int,
                     chain: int, batch: int = 4) -> dict[str, Any]:
    model = random_target(config, device, dtype)
    tokens = random_prompts(config, batch, prompt_len + chain, seed=1).to(device)
    prompt, block = tokens[:, :prompt_len], tokens[:, prompt_len:]
    stepwise, verified = model.new_cache(batch, prompt_len + chain), model.new_cache(batch, prompt_len + chain)
    for cache in (stepwise, verified):
        model.hidden(prompt, cache=cache)
        cache.advance(prompt_len)
    steps = []
    for t in range(chain):
        steps.append(model(block[:, t:t + 1], cache=stepwise))
        stepwise.advance(1)
    at_once = model(block, cache=verified)
    diff = (torch.cat(steps, 1).float() - at_once.float()).abs()
    return {"max_logit_diff": float(diff.max()), "mean_logit_diff": float(diff.mean()), "chain": chain,
            "argmax_agree_rate": float((torch.cat(steps, 1).argmax(-1) == at_once.argmax(-1)).float().mean())}


@torch.no_grad()
def batch_invariance(config: LMConfig, device: torch.device, dtype: torch.dtype, prompt_len: int, batch: int,
                     decode_steps: int = 8) -> dict[str, Any]:
    model = random_target(config, device, dtype)
    prompts = random_prompts(config, batch, prompt_len + decode_steps, seed=2).to(device)

    def row0_logits(rows: torch.Tensor) -> torch.Tensor:  # [1, prompt_len + decode_steps, V]: row 0's
        cache = model.new_cache(rows.shape[0], prompt_len + decode_steps)
        out = [model.logits(model.hidden(rows[:, :prompt_len], cache=cache)[:1])]
        cache.advance(prompt_len)
        for t in range(prompt_len, prompt_len + decode_steps):
            out.append(model.logits(model.hidden(rows[:, t:t + 1], cache=cache)[:1]))
            cache.advance(1)
        return torch.cat(out, 1).float()

    alone, inside = row0_logits(prompts[:1]), row0_logits(prompts)
    diff = (alone - inside).abs()
    return {"batch": batch, "max_logit_diff_prefill": float(diff[:, :prompt_len].max()),
            "max_logit_diff_decode": float(diff[:, prompt_len:].max()),
            "argmax_agree_rate": float((alone.argmax(-1) == inside.argmax(-1)).float().mean())}


@torch.no_grad()
def weight_sync(config: LMConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """A second random model's canonical stream into the engine, timed with the device synced."""
    engine = TorchRolloutEngine(random_target(config, device, dtype, seed=0))
    source = random_target(config, device, dtype, seed=1)
    stream = source.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in stream.values())
    sync(device)
    t0 = time.perf_counter()
    engine.load_policy_weights(stream.items())
    sync(device)
    seconds = time.perf_counter() - t0
    name = next(iter(stream))
    if not torch.equal(engine.target.state_dict()[name], stream[name]):
        raise AssertionError(f"weight_sync: {name} was not loaded")
    return {"tensors": len(stream), "gib": nbytes / 2**30, "seconds": seconds, "gb_s": nbytes / seconds / 1e9}
