"""`nemo-tlt`: the command line. Thin: parse -> build -> run.

    nemo-tlt prepare                      # the demo target, drafter and assistant (shipped, or trained and cached)
    nemo-tlt bench rollout --out F.json   # plain vs SD vs HF transformers
    nemo-tlt bench rollout --engine vllm --out F.json   # vLLM EAGLE-3 vs vLLM plain
    nemo-tlt bench rollout --workload longtail --out F.json
    nemo-tlt bench drafter --out F.json
    nemo-tlt bench precision --out F.json # SD vs plain token identity and speed per dtype
    nemo-tlt bench reshard --out F.json
    nemo-tlt bench load --out F.json      # per-rank peak host memory building a TP2 x PP2 policy from an HF folder
    nemo-tlt bench checkpoint --out F.json  # per-rank peak extra host memory writing a sharded policy checkpoint
    nemo-tlt bench memory --out F.json    # the plan's per-rank memory per RL phase against the tracked memory of CPU ranks
    nemo-tlt bench spec-overhead --out F.json   # vLLM's plain steps with a drafter built in vs without, by target size
    nemo-tlt convert ...                  # checkpoint conversion (Megatron / HF / TensorRT-LLM)
    nemo-tlt drafter train --target DIR --prompts F.jsonl --out DIR   # a first drafter for your target
    nemo-tlt plan CONFIG.yaml [key=value ...]   # memory / reshard plan and simulated speedup (or --calibrate RUN_DIR)
    nemo-tlt train CONFIG.yaml [key=value ...] [--compare-baseline]
    nemo-tlt selfcheck --gpu --out F.json       # the GPU acceptance run (docs/gpu.md); --cpu-dry-run on a CPU
    nemo-tlt selfcheck --trtllm --out F.json    # TensorRT-LLM with a trained EAGLE-3 drafter (docs/trtllm.md)
"""
from __future__ import annotations

import importlib
import logging
import sys

_COMMANDS = {
    ("bench", "rollout"): "nemo_tlt.bench.rollout",
    ("bench", "drafter"): "nemo_tlt.bench.drafter",
    ("bench", "precision"): "nemo_tlt.bench.precision",
    ("bench", "reshard"): "nemo_tlt.bench.reshard",
    ("bench", "load"): "nemo_tlt.bench.load",
    ("bench", "checkpoint"): "nemo_tlt.bench.checkpoint",
    ("bench", "memory"): "nemo_tlt.bench.memory",
    ("bench", "spec-overhead"): "nemo_tlt.bench.spec_overhead",
    ("convert",): "nemo_tlt.convert",
    ("drafter", "train"): "nemo_tlt.first_drafter.cli",
    ("train",): "nemo_tlt.train",
    ("prepare",): "nemo_tlt.demo.prepare",
    ("plan",): "nemo_tlt.plan.cli",
    ("selfcheck",): "nemo_tlt.selfcheck.cli",
}


def _usage() -> str:
    names = sorted(" ".join(k) for k in _COMMANDS)
    return "usage: nemo-tlt {" + " | ".join(names) + "} [options]   (add --help to a command)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for key, module in sorted(_COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(key)]) == key:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name and err.name.startswith("nemo_tlt"):
                    print(f"nemo-tlt {' '.join(key)}: not available in this build ({err.name} is missing)",
                          file=sys.stderr)
                    return 2
                raise
            return int(mod.main(argv[len(key):]) or 0)
    print(_usage(), file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
