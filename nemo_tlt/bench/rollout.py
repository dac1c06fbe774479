"""`nemo-tlt bench rollout`: plain vs speculative decoding vs HF transformers.

All methods run in one process on the same weights and prompts: the embedded
engine plainly (`plain`) and with a fixed-shape EAGLE tree in each acceptance mode
(`sd_greedy`, `sd_rejection`, `sd_coupled`; with `--drafters eagle,eagle3` each
drafter's methods carry its name, e.g. `sd_greedy_eagle3`: both drafters are
trained on the demo with the same recipe, `--drafter-steps` overriding its steps
for both); HF transformers `generate` on the same
target (`hf_generate`) and HF assisted generation with a one-layer assistant LM
(`hf_assisted`). Each method is warmed up on one prompt first. Writes JSON and
prints a table.

`mean_accept_len` has one definition for every method: generated tokens per
target forward per sequence, after prefill, as a ratio of sums over all prompts
(so token-weighted, not a mean of per-prompt ratios):

    mean_accept_len = decode_tokens / decode_row_forwards
    decode_tokens = tokens - prefill_only_rows

* a *row-forward* is one sequence's share of one target forward (a forward over
  a batch of B sequences counts B);
* a *prefill-only* forward takes a prompt and yields that sequence's first token
  and nothing else; `prefill_only_rows` counts the sequences whose first token came
  from one, and neither those forwards nor those tokens count above;
* every other target forward counts: a plain decode step (one token per row) or a
  verification (the accepted draft tokens plus the target's own next token).

The embedded engine and HF `generate` prefill every prompt in a forward of its
own; HF assisted generation fuses the prefill with the first verification, so
none of its forwards is prefill-only. Plain decoding gives exactly 1. With
`--batch-size 1` each forward holds one sequence, so for every method
`mean_accept_len = (tokens - prefill_only_rows) / (target_forwards - prefill_only_rows)`,
the same counts `target_forwards_per_token = target_forwards / tokens` is made of.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.demo.assets import (AssetConfig, default_cache_dir, load_assets, prepare_assets,
                                  prepare_eagle3_drafter, task_requests)
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.drafter.kinds import KIND_ALIASES
from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.bench.common import format_table, machine_info
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

log = logging.getLogger(__name__)
COLUMNS = ["tokens_per_s", "target_forwards_per_token", "mean_accept_len", "wall_s", "tokens"]
ACCEPT_LEN_DEFINITION = ("decode_tokens / decode_row_forwards: generated tokens per target forward per sequence, "
                         "prefill-only forwards and the first token each yields left out, summed over all prompts")


def _batches(reqs: list[Request], size: int) -> list[list[Request]]:
    return [reqs[i: i + size] for i in range(0, len(reqs), size)]


def _cut_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@dataclass(frozen=True)
class Counts:
    """What one method did on one chunk of prompts (see the module docstring)."""

    outputs: list[list[int]]
    target_forwards: int      # target model forwards; a batched forward counts once
    prefill_only_rows: int    # sequences whose first token came from a prefill-only forward
    decode_row_forwards: int  # every other forward, counted once per sequence it held


class Method:
    """One benchmarked method: `run(chunk)` -> `Counts`; `measure` times it and sums them."""

    def __init__(self, name: str, run: Callable[[list[Request]], Counts]) -> None:
        self.name, self.run = name, run
        self.wall = 0.0
        self.tokens = self.forwards = self.prefill_only_rows = self.decode_row_forwards = 0
        self.outputs: list[list[int]] = []

    def measure(self, chunk: list[Request]) -> None:
        t0 = time.perf_counter()
        counts = self.run(chunk)
        self.wall += time.perf_counter() - t0
        self.outputs += counts.outputs
        self.tokens += sum(len(o) for o in counts.outputs)
        self.forwards += counts.target_forwards
        self.prefill_only_rows += counts.prefill_only_rows
        self.decode_row_forwards += counts.decode_row_forwards

    def result(self) -> dict[str, Any]:
        decode_tokens = self.tokens - self.prefill_only_rows
        return {"tokens_per_s": self.tokens / self.wall, "target_forwards_per_token": self.forwards / self.tokens,
                "mean_accept_len": decode_tokens / self.decode_row_forwards if self.decode_row_forwards else 0.0,
                "wall_s": self.wall, "tokens": self.tokens, "target_forwards": self.forwards,
                "prefill_only_rows": self.prefill_only_rows, "decode_tokens": decode_tokens,
                "decode_row_forwards": self.decode_row_forwards}


def engine_method(name: str, engine: TorchRolloutEngine, sp: SamplingParams, policy=None) -> Method:
    def run(chunk: list[Request]) -> Counts:
        out = engine.generate(chunk, sp, policy=policy)
        # The engine prefills in forwards of their own (one first token per row); every
        # later step, plain or SD, is one target forward over the rows still running.
        return Counts([r.tokens for r in out.results], out.stats.target_forwards, len(chunk),
                      sum(step.running for step in out.stats.trace))
    return Method(name, run)


class ForwardLog:
    """Input lengths of every forward of an HF model, from a forward pre-hook."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else (args[0] if args else None)
        if ids is None:
            raise RuntimeError("bench rollout: an HF forward without input_ids; cannot count its tokens")
        self.lengths.append(int(ids.shape[-1]))


def hf_method(name: str, model, forward_log: ForwardLog, max_new: int, eos: int, pad: int, assistant=None) -> Method:
    kw: dict[str, Any] = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    if assistant is not None:
        kw["assistant_model"] = assistant

    @torch.no_grad()
    def run(chunk: list[Request]) -> Counts:
        outs, forwards, prefill_only = [], 0, 0
        for r in chunk:  # HF assisted generation takes one sequence at a time
            ids = torch.tensor([r.prompt])
            forward_log.lengths.clear()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            outs.append(_cut_eos(out[0, ids.shape[1]:].tolist(), eos))
            forwards += len(forward_log.lengths)
            # The first forward prefills; it is prefill-only when it held the prompt alone
            # (assisted generation appends the first draft to it and verifies that too).
            prefill_only += int(bool(forward_log.lengths) and forward_log.lengths[0] == len(r.prompt))
        return Counts(outs, forwards, prefill_only, forwards - prefill_only)
    return Method(name, run)


def _load_hf(folder):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.do_sample = False
    return model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nemo-tlt bench rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="torch: this benchmark; vllm: vLLM EAGLE-3 vs vLLM plain (nemo_tlt.bench.vllm_rollout); "
                        "with --workload longtail, the long-tail methods on that engine (nemo_tlt.bench.longtail)")
    p.add_argument("--workload", choices=["default", "longtail"], default="default")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=12, help="workload size (prompts)")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--shape", default="8_2_16", help="SD tree shape depth_topk_numverify")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help=f"model cache (default {default_cache_dir()})")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers methods")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--drafters", default="eagle",
                   help="comma list of eagle (EAGLE-2's drafter; eagle2 is the same), eagle3; more than one "
                        "suffixes the SD methods with the drafter's name")
    p.add_argument("--drafter-steps", type=int, default=None,
                   help="train every drafter for this many steps (default: the demo recipe's; its "
                        "shipped drafter is used then)")
    p.add_argument("--eagle3-layers", default=None,
                   help="comma list of the target layers (0-based) the EAGLE-3 drafter fuses "
                        "(default: TensorRT-LLM's 1, L//2-1, L-4)")
    p.add_argument("--eagle3-ttt-steps", type=int, default=None,
                   help="draft steps the EAGLE-3 drafter unrolls in training (default: the demo recipe's)")
    args = p.parse_args(argv)
    args.drafter_kinds = [KIND_ALIASES.get(d.strip(), d.strip()) for d in args.drafters.split(",") if d.strip()]
    unknown = sorted(set(args.drafter_kinds) - {"eagle", "eagle3"})
    if unknown or not args.drafter_kinds or len(set(args.drafter_kinds)) != len(args.drafter_kinds):
        p.error(f"--drafters must list eagle and/or eagle3 once each, got {args.drafters!r}")
    if args.drafter_steps is not None and args.drafter_steps < 1:
        p.error(f"--drafter-steps must be >= 1, got {args.drafter_steps}")
    if args.batch_size < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        p.error("--batch-size, --num-prompts and --max-new-tokens must be >= 1")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    args.tree_shape = TreeShape.parse(args.shape, field="--shape")
    if args.eagle3_layers is not None:
        try:
            args.eagle3_layers = tuple(int(x) for x in args.eagle3_layers.split(","))
        except ValueError:
            p.error(f"--eagle3-layers must be comma-separated layer indices, got {args.eagle3_layers!r}")
        if "eagle3" not in args.drafter_kinds:
            p.error("--eagle3-layers needs eagle3 in --drafters")
    if args.eagle3_ttt_steps is not None and (args.eagle3_ttt_steps < 1 or "eagle3" not in args.drafter_kinds):
        p.error(f"--eagle3-ttt-steps must be >= 1 and needs eagle3 in --drafters, got {args.eagle3_ttt_steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _asset_config(args)
    assets = prepare_assets(config, args.cache_dir)
    target, drafters, drafter_dirs = _load_models(args, config, assets)
    _, reqs = task_requests(config.task, args.num_prompts, seed=20_000 + args.seed)
    suffix = {k: (f"_{k}" if len(args.drafter_kinds) > 1 else "") for k in args.drafter_kinds}
    methods = _engine_methods(args, target, drafters, suffix)
    if not args.no_hf:
        methods += _hf_methods(args, target, assets)
    _measure(methods, reqs, args.batch_size)
    results = {m.name: m.result() for m in methods}
    identical, coupled_identical = _outputs_identical(methods, suffix)
    ratios = _ratios(results, suffix)
    payload = {"benchmark": "rollout", "workload": args.workload, "results": results,
               "mean_accept_len_definition": ACCEPT_LEN_DEFINITION, "greedy_outputs_identical": identical,
               "coupled_outputs_identical": coupled_identical, "ratios": ratios, "machine": machine_info(),
               "config": _run_config(args, config, assets, drafters, drafter_dirs)}
    write_json_atomic(args.out, payload)
    print(format_table(results, COLUMNS))
    print("ratios: " + ", ".join(f"{k}={v:.2f}x" for k, v in ratios.items()))
    print(f"greedy_outputs_identical: {identical}; coupled_outputs_identical: {coupled_identical}")
    print(f"wrote {args.out}")
    return 0


def _delegate(argv: list[str] | None) -> int | None:
    """The exit status of the benchmark `--workload longtail` (on either engine: its own
    `--engine`) or `--engine vllm` hands `argv` to; None for this one."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--workload", default="default")
    peek.add_argument("--engine", default="torch")
    if peek.parse_known_args(argv)[0].workload == "longtail":  # on either engine (its own --engine)
        from nemo_tlt.bench.longtail import main as longtail_main
        return longtail_main(argv)
    if peek.parse_known_args(argv)[0].engine == "vllm":
        from nemo_tlt.bench.vllm_rollout import main as vllm_main
        return vllm_main(argv)
    return None


def _asset_config(args: argparse.Namespace) -> AssetConfig:
    """The demo's asset recipe with the drafter options of `args` applied."""
    config = AssetConfig()
    if args.drafter_steps is not None:
        config = replace(config, drafter_train=replace(config.drafter_train, steps=args.drafter_steps))
    if args.eagle3_layers is not None:
        config = replace(config, eagle3_capture_layers=args.eagle3_layers)
    if args.eagle3_ttt_steps is not None:
        config = replace(config, eagle3_ttt_steps=args.eagle3_ttt_steps)
    return config


def _load_models(args: argparse.Namespace, config: AssetConfig, assets) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(target, drafters by kind, their folders by kind): eagle (the shipped one) always, eagle3
    (prepared first) where `--drafters` lists it."""
    target, eagle = load_assets(assets)
    drafter_dirs = {"eagle": assets.drafter_dir}
    drafters = {"eagle": eagle}
    if "eagle3" in args.drafter_kinds:
        drafter_dirs["eagle3"] = prepare_eagle3_drafter(config, args.cache_dir)
        drafters["eagle3"] = load_drafter(drafter_dirs["eagle3"], target)
    return target, drafters, drafter_dirs


def _engine_methods(args: argparse.Namespace, target, drafters: dict[str, Any], suffix: dict[str, str]
                    ) -> list[Method]:
    """The embedded engine's methods: `plain`, then per mode each drafter's `sd_<mode><suffix>`
    and (sampling modes) `plain_<mode>`."""
    plain_engine = TorchRolloutEngine(target)
    policy = FixedSDPolicy(args.tree_shape)
    methods = [engine_method("plain", plain_engine, SamplingParams("greedy", max_new_tokens=args.max_new_tokens))]
    for mode in ("greedy", "rejection", "coupled"):
        sp = SamplingParams(mode, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
        for kind in args.drafter_kinds:
            engine = TorchRolloutEngine(target, drafters[kind])
            methods.append(engine_method(f"sd_{mode}{suffix[kind]}", engine, sp, policy))
        if mode != "greedy":  # the fair baseline of a sampling mode is plain decoding in that mode
            methods.append(engine_method(f"plain_{mode}", plain_engine, sp))
    return methods


def _hf_methods(args: argparse.Namespace, target, assets) -> list[Method]:
    """HF transformers `hf_generate` and `hf_assisted` (a one-layer assistant LM) on the same target."""
    eos, pad = target.config.eos_token_id, target.config.pad_token_id
    hf_target, hf_assistant = _load_hf(assets.target_dir), _load_hf(assets.assistant_dir)
    forwards = ForwardLog(hf_target)
    return [hf_method("hf_generate", hf_target, forwards, args.max_new_tokens, eos, pad),
            hf_method("hf_assisted", hf_target, forwards, args.max_new_tokens, eos, pad, hf_assistant)]


def _measure(methods: list[Method], reqs: list[Request], batch_size: int) -> None:
    """Warms every method up on the first prompt (not timed), then times them on `reqs`."""
    for m in methods:  # warm-up, not timed
        m.run(reqs[:1])
    # Interleave the methods chunk by chunk, so that load changes on a shared
    # machine hit every method alike and the ratios stay meaningful.
    for chunk in tqdm(_batches(reqs, batch_size), desc="bench rollout"):
        for m in methods:
            m.measure(chunk)


def _outputs_identical(methods: list[Method], suffix: dict[str, str]) -> tuple[bool, bool]:
    """(every greedy method emitted plain's tokens, every coupled SD method emitted plain_coupled's)."""
    greedy_names = {"plain", "hf_generate", "hf_assisted", *(f"sd_greedy{x}" for x in suffix.values())}
    greedy_outputs = {m.name: m.outputs for m in methods if m.name in greedy_names}
    outputs = {m.name: m.outputs for m in methods}
    coupled_identical = all(outputs[f"sd_coupled{x}"] == outputs["plain_coupled"] for x in suffix.values())
    ref = greedy_outputs["plain"]
    return all(o == ref for o in greedy_outputs.values()), coupled_identical


def _ratios(results: dict[str, dict[str, Any]], suffix: dict[str, str]) -> dict[str, float]:
    """Tokens/s ratios: every method over plain, each sampling mode's SD over plain in that
    mode, and (with HF) plain over HF generate and greedy SD over HF assisted."""
    base = results["plain"]["tokens_per_s"]
    ratios = {f"{m}_vs_plain": r["tokens_per_s"] / base for m, r in results.items() if m != "plain"}
    for mode in ("rejection", "coupled"):
        for x in suffix.values():
            ratios[f"sd_{mode}{x}_vs_plain_{mode}"] = (results[f"sd_{mode}{x}"]["tokens_per_s"]
                                                     / results[f"plain_{mode}"]["tokens_per_s"])
    if "hf_generate" in results:
        ratios["plain_vs_hf_generate"] = base / results["hf_generate"]["tokens_per_s"]
        for x in suffix.values():
            ratios[f"sd_greedy{x}_vs_hf_assisted"] = (results[f"sd_greedy{x}"]["tokens_per_s"]
                                                      / results["hf_assisted"]["tokens_per_s"])
    return ratios


def _run_config(args: argparse.Namespace, config: AssetConfig, assets, drafters: dict[str, Any],
                drafter_dirs: dict[str, Any]) -> dict[str, Any]:
    """The JSON's "config": the workload, the demo's target and task, and the drafters run."""
    return {"batch_size": args.batch_size, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "shape": args.tree_shape.name,
            "target": config.target.to_dict(), "task": config.task.to_dict(),
            "target_dir": assets.target_dir.name, "drafter_dir": assets.drafter_dir.name,
            "drafters": {k: drafter_dirs[k].name for k in args.drafter_kinds},
            "drafter_train": {"steps": config.drafter_train.steps,
                              "batch_size": config.drafter_train.batch_size,
                              "eagle3_ttt_steps": config.eagle3_ttt_steps},
            **({"eagle3_capture_layers": list(drafters["eagle3"].capture_layers)}
               if "eagle3" in drafters else {})}
