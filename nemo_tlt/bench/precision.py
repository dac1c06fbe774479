"""`nemo-tlt bench precision`: what speculative decoding keeps in bf16, and at what cost.

On the demo target and its shipped EAGLE drafter (as `bench rollout` loads them), per
engine configuration (weights dtype x ``compute_dtype``: fp32; bf16; bf16 weights
computed in fp32, ``rollout.compute_dtype=float32``):

* ``greedy_identity`` / ``coupled_identity``: the share of prompts whose SD tokens are
  identical to plain decoding's in that mode (same engine configuration, same seed);
* ``rejection``: a chi-square goodness-of-fit test of SD rejection sampling against the
  target's exact distribution of the first ``--gof-steps`` tokens of one prompt
  (top-k sampling, so the joint is enumerated exactly with the same engine:
  tests/conformance/test_rejection_distribution.py does the same on a tiny target);
* ``tokens_per_s`` of plain and SD decoding in greedy and coupled mode: chunks of
  ``--batch-size`` prompts, every method on each chunk in turn, the order reversed on
  every other chunk; the median over chunks, with the min and max (``noise``);
* ``weights_bytes`` and the largest KV-cache bytes held (``kv_bytes_max``).

The drafter is served as trained (fp32, see nemo_tlt.drafter.base). Writes JSON and
prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.bench.common import format_table, machine_info
from nemo_tlt.demo.assets import AssetConfig, default_cache_dir, prepare_assets, task_requests
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams, process_logits
from nemo_tlt.speculative.tree_shape import TreeShape

CONFIGS = {  # name -> (weights dtype, compute dtype)
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "bfloat16_compute_float32": (torch.bfloat16, torch.float32),
}
COLUMNS = ["greedy_identity", "coupled_identity", "rejection_pvalue", "plain_greedy_tok_s", "sd_greedy_tok_s",
           "plain_coupled_tok_s", "sd_coupled_tok_s", "weights_bytes", "kv_bytes_max"]


def identity_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of sequences whose tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def exact_topk_joint(engine: TorchRolloutEngine, prompt: tuple[int, ...], sampling: SamplingParams,
                     steps: int) -> dict[tuple[int, ...], float]:
    """The probability of every first-`steps`-token continuation of `prompt` under top-k
    sampling (``sampling.top_k`` > 0), by enumerating the prefixes the top-k leaves
    possible; each prefix's distribution comes from the engine's own plain greedy decode
    of it (so the engine's arithmetic, cache included, defines "the target")."""
    joint = {(): 1.0}
    for _ in range(steps):
        nxt: dict[tuple[int, ...], float] = {}
        prefixes = list(joint)
        logp = _next_logprobs(engine, [prompt + p for p in prefixes], sampling)
        for prefix, row in zip(prefixes, logp):
            for tok in torch.nonzero(torch.isfinite(row)).flatten().tolist():
                nxt[prefix + (tok,)] = joint[prefix] * float(row[tok].exp())
        joint = nxt
    return joint


def _next_logprobs(engine: TorchRolloutEngine, prompts: list[tuple[int, ...]],
                   sampling: SamplingParams) -> torch.Tensor:
    """Processed next-token log-probs after each prompt, from a plain forward of the engine."""
    out = engine.generate([Request(p) for p in prompts], SamplingParams("greedy", max_new_tokens=1),
                          return_hidden=True)
    last = torch.stack([r.hidden_states[-1] for r in out.results])
    with torch.no_grad():
        return process_logits(engine.target.logits(last), sampling).float().cpu()


def rejection_fit(engine: TorchRolloutEngine, prompt: tuple[int, ...], shape: TreeShape, n: int, steps: int,
                  seed: int) -> dict[str, Any]:
    """Chi-square goodness of fit of `n` SD rejection rollouts against the exact joint."""
    from scipy.stats import chisquare
    sampling = SamplingParams("rejection", temperature=1.0, top_k=4, max_new_tokens=steps, seed=seed,
                              stop_on_eos=False)
    joint = exact_topk_joint(engine, prompt, sampling, steps)
    out = engine.generate([Request(prompt, seq_id=i) for i in range(n)], sampling, policy=FixedSDPolicy(shape))
    counts: dict[tuple[int, ...], int] = {}
    for r in out.results:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    outside = sum(c for k, c in counts.items() if k not in joint)
    keys = sorted(joint, key=joint.get, reverse=True)
    big = [k for k in keys if joint[k] * n >= 5]
    small = [k for k in keys if joint[k] * n < 5]
    obs = [counts.get(k, 0) for k in big] + ([sum(counts.get(k, 0) for k in small)] if small else [])
    exp = [joint[k] * n for k in big] + ([sum(joint[k] for k in small) * n] if small else [])
    test = chisquare(np.array(obs), np.array(exp) * sum(obs) / sum(exp))
    return {"pvalue": float(test.pvalue) if not outside else 0.0, "statistic": float(test.statistic),
            "cells": len(obs), "rollouts": n, "outside_support": outside, "steps": steps, "top_k": 4,
            "mean_accept_len": out.stats.mean_accept_len}


class _Timed:
    def __init__(self, name: str, engine: TorchRolloutEngine, sampling: SamplingParams, policy) -> None:
        self.name, self.engine, self.sampling, self.policy = name, engine, sampling, policy
        self.outputs: list[list[int]] = []
        self.rates: list[float] = []
        self.kv_max = 0

    def run(self, chunk: list[Request]) -> None:
        t0 = time.perf_counter()
        out = self.engine.generate(chunk, self.sampling, policy=self.policy)
        dt = time.perf_counter() - t0
        self.outputs += [r.tokens for r in out.results]
        self.rates.append(sum(len(r.tokens) for r in out.results) / dt)
        self.kv_max = max([self.kv_max] + [t.kv_bytes for t in out.stats.trace])


def measure_config(name: str, args, assets, reqs: list[Request], shape: TreeShape) -> dict[str, Any]:
    dtype, compute = CONFIGS[name]
    target = load_hf_folder(assets.target_dir, dtype)
    drafter = load_drafter(assets.drafter_dir, target)
    plain = TorchRolloutEngine(target, compute_dtype=compute)
    sd = TorchRolloutEngine(target, drafter, compute_dtype=compute)
    policy = FixedSDPolicy(shape)
    methods = []
    for mode in ("greedy", "coupled"):
        sp = SamplingParams(mode, max_new_tokens=args.max_new_tokens, seed=args.seed)
        methods += [_Timed(f"plain_{mode}", plain, sp, None), _Timed(f"sd_{mode}", sd, sp, policy)]
    for m in methods:  # warm-up, not kept
        m.engine.generate(reqs[:1], m.sampling, policy=m.policy)
    for i in range(0, len(reqs), args.batch_size):
        for m in (methods if (i // args.batch_size) % 2 == 0 else methods[::-1]):
            m.run(reqs[i: i + args.batch_size])
    by = {m.name: m for m in methods}
    row: dict[str, Any] = {
        "weights_dtype": str(dtype).replace("torch.", ""),
        "compute_dtype": str(plain.compute_dtype).replace("torch.", ""),
        "greedy_identity": identity_rate(by["plain_greedy"].outputs, by["sd_greedy"].outputs),
        "coupled_identity": identity_rate(by["plain_coupled"].outputs, by["sd_coupled"].outputs),
        "weights_bytes": sum(p.numel() * p.element_size() for p in plain.target.parameters()),
        "kv_bytes_max": max(m.kv_max for m in methods),
    }
    for m in methods:
        row[f"{m.name}_tok_s"] = statistics.median(m.rates)
        row[f"{m.name}_tok_s_noise"] = [min(m.rates), max(m.rates)]
    fit = rejection_fit(sd, reqs[0].prompt, TreeShape(2, 2, 4), args.gof_rollouts, args.gof_steps, args.seed)
    row["rejection_pvalue"], row["rejection"] = fit["pvalue"], fit
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nemo-tlt bench precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--shape", default="8_2_16", help="SD tree shape depth_topk_numverify")
    p.add_argument("--gof-rollouts", type=int, default=4000, help="SD rejection rollouts for the fit test")
    p.add_argument("--gof-steps", type=int, default=3, help="tokens per rollout in the fit test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cache-dir", default=None, help=f"model cache (default {default_cache_dir()})")
    args = p.parse_args(argv)
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_names if c not in CONFIGS]
    if bad or not args.config_names:
        p.error(f"--configs must list some of {', '.join(CONFIGS)}, got {args.configs!r}")
    if min(args.num_prompts, args.batch_size, args.max_new_tokens, args.gof_rollouts, args.gof_steps) < 1:
        p.error("--num-prompts, --batch-size, --max-new-tokens, --gof-rollouts and --gof-steps must be >= 1")
    args.tree_shape = TreeShape.parse(args.shape, field="--shape")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = AssetConfig()
    assets = prepare_assets(config, args.cache_dir)
    _, reqs = task_requests(config.task, args.num_prompts, seed=20_000 + args.seed)
    results = {name: measure_config(name, args, assets, reqs, args.tree_shape) for name in args.config_names}
    payload = {"benchmark": "precision", "results": results, "machine": machine_info(),
               "config": {"num_prompts": args.num_prompts, "batch_size": args.batch_size,
                          "max_new_tokens": args.max_new_tokens, "shape": args.tree_shape.name,
                          "gof_rollouts": args.gof_rollouts, "gof_steps": args.gof_steps, "seed": args.seed,
                          "target_dir": assets.target_dir.name, "drafter_dir": assets.drafter_dir.name,
                          "timing": "median tokens/s over chunks of batch_size prompts, methods in turn per "
                                    "chunk, order reversed every other chunk; *_noise = [min, max] over chunks"}}
    write_json_atomic(args.out, payload)
    print(format_table(results, COLUMNS))
    print(f"wrote {args.out}")
    return 0
