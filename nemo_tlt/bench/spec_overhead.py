"""`nemo-tlt bench spec-overhead --engine vllm`: what a vLLM engine built with an EAGLE-3
drafter costs on steps that do not draft, by target size.

vLLM 0.32 runs the drafter's first pass on every step of an engine built with a drafter, at
draft length 0 too, to keep the drafter's KV cache in step with the target's
(``v1/spec_decode/llm_base_proposer.py``, ``propose``). TLT's plain steps on such an engine
(the learned SD policy choosing plain decoding, or a drafter judged collapsed) therefore cost
more than vLLM built without a drafter. The pass is one decoder layer and the fusion of the
captured features, so its share falls with the target's depth and width: this benchmark
measures it on random Llama-shaped targets (``--shapes``, hidden x layers) with a random
EAGLE-3 drafter of the target's shape (capturing TensorRT-LLM's default layers).

Per shape, three methods decode the same random prompts greedily, to ``--max-new-tokens``
(EOS ignored), in a batch of ``--batch``: ``plain`` (an engine built without a drafter),
``plain_drafter_built`` (an engine built with one, draft length 0 on every step) and
``plain_again`` (the control: ``plain``'s work again on its engine). Rounds alternate the
methods' order; each method is warmed up first. The figure is the process's CPU time per
generated token (vLLM's engine core and worker run in this process; one torch thread), the
ratio ``plain_drafter_built / plain`` per round, and its median and range over rounds beside
the control's; ``noise_exceeds_effect`` says where the control's range reaches the ratio's
distance from 1.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nemo_tlt.bench.common import format_table, machine_info, write_summary
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams

METHODS = ("plain", "plain_drafter_built", "plain_again")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"128x16,1024x32"`` -> [(hidden, layers), ...]; a ValueError naming the flag otherwise."""
    shapes = []
    for part in text.split(","):
        try:
            hidden, layers = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {part!r} is not HIDDENxLAYERS (e.g. 1024x32)") from None
        if hidden < 128 or hidden % 64 or layers < 7:
            raise ValueError(f"--shapes: {part!r} needs a hidden size that is a multiple of 64 and >= 128 (vLLM's "
                             "CPU attention takes heads of 32 and more) and >= 7 layers (the drafter's captured "
                             "layers, TensorRT-LLM's default, are distinct from 7 on)")
        shapes.append((hidden, layers))
    return shapes


def target_config(hidden: int, layers: int, vocab: int):
    """A Llama-shaped config: head size 64, 4 query heads per KV head (at least 4 and 2), MLP
    width 11/4 of the hidden size rounded to 64."""
    from nemo_tlt.model.config import LMConfig

    heads = max(4, hidden // 64)
    return LMConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64 * round(hidden * 11 / 4 / 64),
                    num_layers=layers, num_heads=heads, num_kv_heads=max(2, heads // 4), max_position_embeddings=1024)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nemo-tlt bench spec-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm"], default="vllm")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shapes", default="128x16,512x16,1024x16,1024x32", help="comma list of HIDDENxLAYERS")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.shape_list = parse_shapes(args.shapes)
    except ValueError as err:
        p.error(str(err))
    for name in ("vocab", "batch", "prompt_len", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab < 8:
        p.error(f"--vocab must be >= 8, got {args.vocab}")
    if args.kv_cache_gib <= 0:
        p.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    return args


def cpu_ms_per_token(engine, requests: list[Request], sampling: SamplingParams) -> float:
    c0 = time.process_time()
    out = engine.generate(requests, sampling)
    return (time.process_time() - c0) * 1000 / sum(len(r.tokens) for r in out.results)


def bench_shape(hidden: int, layers: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
    from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
    from nemo_tlt.model.hf_io import save_hf_folder
    from nemo_tlt.model.lm import DecoderLM
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine  # lazy: optional package

    cfg = target_config(hidden, layers, args.vocab)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    target = DecoderLM(cfg)
    target_params = sum(p.numel() for p in target.parameters())
    save_hf_folder(target, folder / "target")
    del target
    drafter = Eagle3Drafter(Eagle3Config.from_target(cfg), generator=gen)
    drafter_layer = sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith(("embed", "lm_head")))
    (folder / "drafter").mkdir()
    write_eagle3_hf(drafter, folder / "drafter")
    common = dict(num_speculative_tokens=1, max_num_seqs=args.batch, kv_cache_gib=args.kv_cache_gib, dtype="float32",
                  seed=args.seed, max_model_len=args.prompt_len + args.max_new_tokens + 1)
    built = VLLMRolloutEngine.from_hf_folder(folder / "target", drafter_dir=str(folder / "drafter"), **common)
    plain = VLLMRolloutEngine.from_hf_folder(folder / "target", **common)
    try:
        requests = [Request([cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (args.prompt_len,),
                                                               generator=gen).tolist(), seq_id=i)
                    for i in range(args.batch)]
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, stop_on_eos=False)
        engines = {"plain": plain, "plain_drafter_built": built, "plain_again": plain}
        for engine in (plain, built):  # warm-up
            engine.generate(requests, sampling)
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            rounds.append({m: cpu_ms_per_token(engines[m], requests, sampling) for m in order})
    finally:
        built.close()
        plain.close()
    return summarize(rounds) | {"hidden": hidden, "layers": layers, "target_params": target_params,
                                "drafter_layer_params": drafter_layer}


def summarize(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Medians per method, the per-round ratios to ``plain`` (overhead and control), and whether
    the control's spread reaches the effect."""
    ratio = [rd["plain_drafter_built"] / rd["plain"] for rd in rounds]
    control = [rd["plain_again"] / rd["plain"] for rd in rounds]
    effect = abs(statistics.median(ratio) - 1)
    return {"ms_per_token": {m: statistics.median(rd[m] for rd in rounds) for m in METHODS},
            "overhead": statistics.median(ratio), "overhead_rounds": ratio,
            "control": statistics.median(control), "control_rounds": control,
            "noise_exceeds_effect": max(abs(c - 1) for c in control) >= effect}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for hidden, layers in args.shape_list:
        with tempfile.TemporaryDirectory(prefix="nemo_tlt_spec_overhead_") as folder:
            results[f"{hidden}x{layers}"] = bench_shape(hidden, layers, args, Path(folder))
    rows = {name: {"params (M)": r["target_params"] / 1e6, "ms/token plain": r["ms_per_token"]["plain"],
                   "ms/token drafter built": r["ms_per_token"]["plain_drafter_built"],
                   "overhead": r["overhead"], "control": r["control"],
                   "noisy": r["noise_exceeds_effect"]} for name, r in results.items()}
    print(format_table(rows, ["params (M)", "ms/token plain", "ms/token drafter built", "overhead", "control",
                              "noisy"]))
    summary = {"benchmark": "spec-overhead --engine vllm", "machine": machine_info(),
               "settings": {k: v for k, v in vars(args).items() if k != "shape_list"}, "shapes": results}
    return write_summary(summary, args.out, True)
