"""``nemo-tlt drafter train``: a first drafter for your target, in one command.

    nemo-tlt drafter train --target MODEL_DIR --prompts PROMPTS.jsonl --out DIR [--type eagle|eagle3]

The target answers your prompts (plain decoding, the embedded engine), the drafter
trains on those responses and the hidden states of the same forward (packed batches,
checkpoints in DIR; rerun the same command to resume a partial run), and greedy
speculative decoding on a held-back share of the prompts measures its mean accepted
length, written to DIR/report.json. DIR is a drafter folder (``model.drafter_dir``);
an eagle3 one exports with ``nemo-tlt convert --from drafter --to eagle3-hf``.
Walkthrough: docs/drafters.md. Exit code 0 on success, 2 on a usage or input error.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from nemo_tlt.drafter.kinds import KIND_ALIASES
from nemo_tlt.first_drafter.run import KINDS, FirstDrafterConfig, make_first_drafter

_D = FirstDrafterConfig.__dataclass_fields__


def _default(name: str):
    return _D[name].default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-tlt drafter train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("inputs and output")
    io.add_argument("--target", required=True, help="the target model folder (HF format: config.json + safetensors)")
    io.add_argument("--prompts", required=True,
                    help="prompts: a JSONL file (one object per line) or a local .json / .parquet datasets file")
    io.add_argument("--prompt-key", default=_default("prompt_key"), help="the key / column holding the prompt text")
    io.add_argument("--out", required=True, help="the drafter folder to write (or the partial run to resume)")
    io.add_argument("--type", dest="kind", choices=(*KINDS, *KIND_ALIASES), default=_default("kind"),
                    help="eagle (EAGLE-2's drafter; eagle2 is the same): one layer on the final hidden state; "
                         "eagle3: fuses three target layers (exportable to the EAGLE-3 HF layout)")
    io.add_argument("--overwrite", action="store_true", help="replace a finished (or other) run in --out")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", default=_default("tokenizer"),
                     help="auto: the HF tokenizer saved in --target (the demo's character tokenizer for a demo "
                          "target); hf; or an import path package.module:factory")
    tok.add_argument("--chat-template", action="store_true", help="render each prompt as a user turn through the "
                                                                  "tokenizer's chat template")
    tok.add_argument("--system-prompt", default=None, help="a system turn before each prompt (with --chat-template)")
    gen = p.add_argument_group("the target's responses")
    gen.add_argument("--temperature", type=float, default=_default("temperature"), help="0: greedy")
    gen.add_argument("--top-p", type=float, default=_default("top_p"))
    gen.add_argument("--top-k", type=int, default=_default("top_k"), help="0 disables")
    gen.add_argument("--max-new-tokens", type=int, default=_default("max_new_tokens"))
    gen.add_argument("--responses", type=int, default=_default("responses"), help="responses per training prompt")
    gen.add_argument("--gen-batch", type=int, default=_default("gen_batch"), help="requests per engine batch")
    tr = p.add_argument_group("training")
    tr.add_argument("--steps", type=int, default=_default("steps"))
    tr.add_argument("--batch-size", type=int, default=_default("batch_size"), help="responses per step")
    tr.add_argument("--lr", type=float, default=_default("lr"))
    tr.add_argument("--warmup-steps", type=int, default=_default("warmup_steps"))
    tr.add_argument("--pack-tokens", type=int, default=_default("pack_tokens"),
                    help="training pairs per packed row (raised to the longest response)")
    tr.add_argument("--ttt-steps", type=int, default=None, help="eagle3: draft steps unrolled (default: tree depth)")
    tr.add_argument("--checkpoint-every", type=int, default=_default("checkpoint_every"))
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--eval-fraction", type=float, default=_default("eval_fraction"),
                    help="share of the prompts held back to measure the accepted length")
    ev.add_argument("--tree", default=_default("tree"), help="draft tree depth_topk_numverify")
    p.add_argument("--seed", type=int, default=_default("seed"), help="prompt split, sampling, init and training")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"nemo-tlt drafter train: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    options = {k: v for k, v in vars(args).items() if k not in ("overwrite", "threads", "no_progress")}
    try:
        report = make_first_drafter(FirstDrafterConfig(**options), args.overwrite, not args.no_progress)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"nemo-tlt drafter train: error: {err}", file=sys.stderr)
        return 2
    summary = {k: report[k] for k in ("mean_accept_len", "tree", "type", "steps", "samples")}
    print(f"nemo-tlt drafter train: wrote {args.out} {json.dumps(summary)} in {report['time_s']['total']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
