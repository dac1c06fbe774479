"""`nemo-tlt bench rollout --engine vllm`: vLLM with EAGLE-3 speculation vs vLLM plain decoding.

One vLLM engine serves the demo target with the shipped EAGLE-3 demo drafter (exported to
the HF layout); the methods differ only in the draft-length schedule installed before each
call: ``plain`` (0 everywhere), ``eagle3`` (a chain of ``--depth`` at every batch size) and
``plain_again`` (the control: the same work as ``plain``). Per batch size, the workload is
``max(batch, --min-prompts)`` demo prompts decoded greedily in chunks of the batch size, to EOS
or ``--max-new-tokens`` (greedy: every method decodes the same tokens, which is checked).
Rounds alternate the methods' order; each method is warmed up once first. Reported per batch
size: the medians of tokens/s, the speedup ``eagle3 / plain`` and the control
``plain_again / plain`` (median and range over rounds: the noise), vLLM's mean accepted length
(tokens per draft) and the share of sequences identical to plain decoding.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.bench.common import format_table, machine_info, write_summary
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.demo.tasks import ArithTaskSource
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

METHODS = ("plain", "eagle3", "plain_again")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nemo-tlt bench rollout --engine vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm"], default="vllm")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--depth", type=int, default=4, help="EAGLE-3 draft tokens per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    for name in ("min_prompts", "max_new_tokens", "depth", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.sizes or min(args.sizes) < 1:
        p.error(f"--batch-sizes must be >= 1, got {args.batch_sizes!r}")
    return args


def demo_requests(n: int, seed: int) -> list[Request]:
    tok = CharTokenizer()
    prompts = ArithTaskSource().prompts(0, n, np.random.default_rng(20_000 + seed))
    return [Request(tok.encode(p.text, add_bos=True), seq_id=i) for i, p in enumerate(prompts)]


def run_method(engine, reqs: list[Request], batch: int, sp: SamplingParams, policy) -> dict[str, Any]:
    tokens, accepts, seconds = [], [], 0.0
    for i in range(0, len(reqs), batch):
        t0 = time.perf_counter()
        out = engine.generate(reqs[i:i + batch], sp, policy=policy)
        seconds += time.perf_counter() - t0
        tokens += [r.tokens for r in out.results]
        accepts += out.stats.accept_lengths
    n = sum(len(t) for t in tokens)
    return {"tokens": tokens, "tokens_per_s": n / seconds, "seconds": seconds,
            "mean_accept_len": sum(accepts) / len(accepts) if accepts else None}


def bench_batch(engine, reqs: list[Request], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    policies = {"plain": None, "eagle3": FixedSDPolicy(TreeShape(args.depth, 1, args.depth)), "plain_again": None}
    for name in METHODS:  # warm-up
        run_method(engine, reqs[:batch], batch, sp, policies[name])
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        rounds.append({name: run_method(engine, reqs, batch, sp, policies[name]) for name in order})
    med = {m: statistics.median(rd[m]["tokens_per_s"] for rd in rounds) for m in METHODS}
    speedups = [rd["eagle3"]["tokens_per_s"] / rd["plain"]["tokens_per_s"] for rd in rounds]
    controls = [rd["plain_again"]["tokens_per_s"] / rd["plain"]["tokens_per_s"] for rd in rounds]
    plain_tokens = rounds[0]["plain"]["tokens"]
    same = [sum(a == b for a, b in zip(rd["eagle3"]["tokens"], plain_tokens)) / len(plain_tokens) for rd in rounds]
    return {"prompts": len(reqs), "tokens_per_s": med,
            "speedup": statistics.median(speedups), "speedup_rounds": speedups,
            "control": statistics.median(controls), "control_rounds": controls,
            "mean_accept_len": statistics.median(rd["eagle3"]["mean_accept_len"] for rd in rounds),
            "greedy_identical": min(same)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine  # lazy: optional package

    with tempfile.TemporaryDirectory(prefix="nemo_tlt_eagle3_") as drafter_dir:
        write_eagle3_hf(load_drafter(shipped_eagle3_drafter()), drafter_dir)
        engine = VLLMRolloutEngine.from_hf_folder(SHIPPED_DIR / "target", drafter_dir=drafter_dir,
                                                  num_speculative_tokens=args.depth, max_num_seqs=max(args.sizes),
                                                  kv_cache_gib=args.kv_cache_gib, dtype="float32", seed=args.seed)
        results = {}
        for batch in args.sizes:
            reqs = demo_requests(max(batch, args.min_prompts), args.seed)
            results[str(batch)] = bench_batch(engine, reqs, batch, args)
    rows = {f"batch {b}": {"plain tok/s": r["tokens_per_s"]["plain"], "eagle3 tok/s": r["tokens_per_s"]["eagle3"],
                           "speedup": r["speedup"], "control": r["control"], "accept": r["mean_accept_len"],
                           "identical": r["greedy_identical"]} for b, r in results.items()}
    print(format_table(rows, ["plain tok/s", "eagle3 tok/s", "speedup", "control", "accept", "identical"]))
    summary = {"benchmark": "rollout --engine vllm", "machine": machine_info(),
               "settings": {k: v for k, v in vars(args).items() if k != "sizes"}, "batch": results}
    ok = all(r["greedy_identical"] == 1.0 for r in results.values())
    return write_summary(summary, args.out, ok)
