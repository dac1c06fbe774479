"""The embedded engine on one device and dtype: is SD still plain decoding, and how fast is it.

``engine_check(case, device, dtype, batch_sizes, ...)`` builds the case's target and drafter
on ``device`` in ``dtype`` and returns, as plain values:

* ``identity``: for greedy and coupled sampling, the share of sequences whose SD tokens
  equal plain decoding's (same engine, same device and dtype), and whether all were;
* ``tokens_per_s``: per batch size, plain decoding, SD (greedy, the case's tree) and
  HF transformers' ``generate`` (greedy, left-padded batch) over the same prompts, every
  method timed once after an untimed warm-up, in an order that alternates per batch size;
  ``accept_len`` is SD's mean accepted length (tokens per verify step).

``kv_fraction_check`` runs the engine under ``rollout.kv_cache_fraction`` on the device (the
free memory read there, its budget binding).

Cases: ``demo_case`` (the shipped demo target and EAGLE drafter, task prompts) and
``random_case`` (a randomly initialised model of a given ``LMConfig``, built here with an
untrained drafter: it measures the mechanics, not acceptance; its identity is a rate to
record, ties in near-uniform logits being common).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.free_memory import free_bytes
from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.kv_admission import engine_slot_bytes
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.selfcheck.kernel_checks import sync
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

@dataclass
class EngineCase:
    name: str
    hf_dir: Path                   # the target as an HF folder (the engine and HF load it alike)
    drafter: torch.nn.Module       # on the host, fp32
    prompts: list[list[int]]
    shape: TreeShape
    max_new_tokens: int


def demo_case(num_prompts: int, max_new_tokens: int, cache_dir: str | None = None) -> EngineCase:
    from nemo_tlt.demo.assets import AssetConfig, load_assets, prepare_assets, task_requests

    config = AssetConfig()
    assets = prepare_assets(config, cache_dir, progress=False)
    _, drafter = load_assets(assets)
    _, reqs = task_requests(config.task, num_prompts, seed=20_000)
    return EngineCase("demo", Path(assets.target_dir), drafter, [list(r.prompt) for r in reqs],
                      TreeShape(depth=6, topk=2, num_verify=12), max_new_tokens)


def random_case(config: LMConfig, folder: Path, num_prompts: int, prompt_len: int, max_new_tokens: int,
                seed: int = 0) -> EngineCase:
    """A random model of ``config`` saved to ``folder``, an untrained one-layer drafter for
    it, and random prompts of ``prompt_len`` tokens (no special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        target = DecoderLM(config).init_weights_(gen)
    save_hf_folder(target, folder)
    drafter = EagleDrafter(EagleConfig(dataclasses.replace(config, num_layers=1)), generator=gen).eval()
    low = 3 + max(config.bos_token_id, config.eos_token_id, config.pad_token_id) if config.vocab_size > 1000 else 3
    prompts = torch.randint(low, config.vocab_size, (num_prompts, prompt_len), generator=gen).tolist()
    return EngineCase(f"random_{config.num_layers}L_{config.hidden_size}H", folder, drafter, prompts,
                      TreeShape(depth=4, topk=2, num_verify=8), max_new_tokens)


def _engine_tokens(engine: TorchRolloutEngine, prompts: list[list[int]], sp: SamplingParams, policy) -> tuple:
    out = engine.generate([Request(p, seq_id=i) for i, p in enumerate(prompts)], sp, policy=policy)
    return [r.tokens for r in out.results], out.stats


def identity(engine: TorchRolloutEngine, case: EngineCase, seed: int) -> dict[str, Any]:
    """Greedy and coupled SD against plain decoding on the same engine. Raises when an
    engine that computes in fp32 (``engine.compute_dtype``) is not token-identical: that
    is the lossless promise; in bf16 arithmetic the rates are recorded, not required."""
    policy = FixedSDPolicy(case.shape)
    out: dict[str, Any] = {}
    for mode in ("greedy", "coupled"):
        sp = SamplingParams(mode, temperature=1.0, max_new_tokens=case.max_new_tokens, seed=seed)
        plain, _ = _engine_tokens(engine, case.prompts, sp, None)
        sd, stats = _engine_tokens(engine, case.prompts, sp, policy)
        same = sum(a == b for a, b in zip(plain, sd))
        out[mode] = {"identical_rate": same / len(plain), "all_identical": same == len(plain),
                     "sequences": len(plain), "accept_len": float(stats.mean_accept_len)}
    broken = [m for m in out if not out[m]["all_identical"]]
    if broken and engine_computes_fp32(engine):
        raise AssertionError(f"{case.name}: SD is not token-identical to plain decoding in fp32 arithmetic in "
                             f"mode(s) {broken}: {out}")
    return out


def engine_computes_fp32(engine: TorchRolloutEngine) -> bool:
    return engine.compute_dtype == torch.float32


def _hf_generate(model, prompts: list[list[int]], max_new: int, eos: int, pad: int, device: torch.device) -> int:
    """Greedy HF generate over one left-padded batch; returns the tokens generated (to EOS)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device="cpu")
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
    made = 0
    for row in out[:, width:].tolist():
        made += row.index(eos) + 1 if eos in row else len(row)
    return made


def throughput(engine: TorchRolloutEngine, hf_model, case: EngineCase, batch: int, device: torch.device,
               order: int) -> dict[str, Any]:
    prompts = case.prompts[:batch]
    sp = SamplingParams("greedy", max_new_tokens=case.max_new_tokens)
    cfg = engine.model_config
    policy = FixedSDPolicy(case.shape)
    runs = {"plain": lambda: _engine_tokens(engine, prompts, sp, None),
            "sd": lambda: _engine_tokens(engine, prompts, sp, policy)}
    if hf_model is not None:
        runs["hf_generate"] = lambda: _hf_generate(hf_model, prompts, case.max_new_tokens, cfg.eos_token_id,
                                                   cfg.pad_token_id, device)
    names = list(runs) if order % 2 == 0 else list(reversed(runs))
    result: dict[str, Any] = {"batch": len(prompts), "order": names}
    for name in names:
        runs[name]()  # warm-up (allocator, kernels), not timed
        sync(device)
        t0 = time.perf_counter()
        value = runs[name]()
        sync(device)
        seconds = time.perf_counter() - t0
        tokens = value if isinstance(value, int) else sum(len(t) for t in value[0])
        result[f"{name}_tokens_per_s"] = tokens / seconds
        if name == "sd":
            result["sd_accept_len"] = float(value[1].mean_accept_len)
    if hf_model is not None:
        result["plain_vs_hf_generate"] = result["plain_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    result["sd_vs_plain"] = result["sd_tokens_per_s"] / result["plain_tokens_per_s"]
    return result


def _load_hf(folder: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    model.generation_config.do_sample = False
    return model


def engine_check(case: EngineCase, device: torch.device, dtype: torch.dtype, batch_sizes: tuple[int, ...],
                 seed: int = 7, with_hf: bool = True, compute_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """See the module docstring; ``compute_dtype`` is the engine's (``rollout.compute_dtype``)."""
    target = load_hf_folder(case.hf_dir, dtype).to(device)
    drafter = case.drafter.to(device)  # the engine serves a drafter at its own dtype (see the engine)
    engine = TorchRolloutEngine(target, drafter, compute_dtype=compute_dtype)
    hf_model = _load_hf(case.hf_dir, device, dtype) if with_hf else None
    out: dict[str, Any] = {"case": case.name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                           "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
                           "identity": identity(engine, case, seed)}
    out["throughput"] = [throughput(engine, hf_model, case, b, device, i) for i, b in enumerate(batch_sizes)]
    return out


def kv_fraction_check(case: EngineCase, device: torch.device, rows_at_once: int = 2) -> dict[str, Any]:
    """``rollout.kv_cache_fraction`` on ``device``: the fraction of the free memory read here
    (``free_bytes``) that holds ``rows_at_once`` of the case's longest rows, SD greedy in fp32.
    Raises unless the budget bound (the unbounded engine held more KV than it) and the KV bytes
    held stayed within the budget the engine read for the call. The share of sequences whose
    tokens equal the unbounded engine's is recorded, not required: decoded in waves, a row sits
    in smaller batches, which a GPU's kernels may round differently."""
    target = load_hf_folder(case.hf_dir, torch.float32).to(device)
    drafter = case.drafter.to(device)
    reqs = [Request(p, seq_id=i) for i, p in enumerate(case.prompts)]
    sp = SamplingParams("greedy", max_new_tokens=case.max_new_tokens, stop_on_eos=False)
    policy = FixedSDPolicy(case.shape)
    unbounded = TorchRolloutEngine(target, drafter).generate(reqs, sp, policy=policy)
    need = max(map(len, case.prompts)) + case.max_new_tokens
    fraction = rows_at_once * need * engine_slot_bytes(target, drafter) / free_bytes(device)
    engine = TorchRolloutEngine(target, drafter, kv_cache_fraction=fraction)
    out = engine.generate(reqs, sp, policy=policy)
    budget, peak = engine.last_kv_budget, max(t.kv_bytes for t in out.stats.trace)
    same = sum(a.tokens == b.tokens for a, b in zip(out.results, unbounded.results))
    result = {"device": str(device), "fraction": fraction, "budget": budget.source, "budget_bytes": budget.bytes,
              "kv_bytes_peak": peak, "kv_bytes_peak_unbounded": max(t.kv_bytes for t in unbounded.stats.trace),
              "prefill_forwards": out.stats.prefill_forwards,
              "prefill_forwards_unbounded": unbounded.stats.prefill_forwards,
              "identical_rate": same / len(reqs)}
    if not peak <= budget.bytes < result["kv_bytes_peak_unbounded"]:
        raise AssertionError(f"rollout.kv_cache_fraction on {device}: {result}")
    return result


def scratch_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="nemo-tlt-selfcheck-")
