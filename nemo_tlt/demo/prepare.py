"""`nemo-tlt prepare`: the demo target, drafter and assistant, ready for the main job and benchmarks.

    nemo-tlt prepare                       # use the shipped models (or train the missing ones into the cache)
    nemo-tlt prepare --rebuild             # train all three into the cache, ignoring the shipped ones
    nemo-tlt prepare --rebuild --ship DIR  # ... and write them as package data (manifest + checksums)

The package data lives in ``nemo_tlt/demo/demo_assets``; ``--ship`` there replaces it.
"""
from __future__ import annotations

import argparse
import platform
from dataclasses import asdict

import torch

from nemo_tlt.demo.assets import AssetConfig, default_cache_dir, load_assets, measure_acceptance, prepare_assets
from nemo_tlt.demo.shipped_assets import write_shipped
from nemo_tlt.speculative.tree_shape import TreeShape

# The acceptance probe recorded in the manifest and re-run by the tests: greedy SD
# with a demo arm on a batch of task prompts the drafter was not trained on.
PROBE = {"shape": "6_2_12", "num_prompts": 8, "max_new_tokens": 96, "seed": 20_000}


def probe_acceptance(assets) -> dict:
    target, drafter = load_assets(assets)
    measured = measure_acceptance(target, drafter, AssetConfig().task, TreeShape.parse(PROBE["shape"]),
                                  PROBE["num_prompts"], PROBE["max_new_tokens"], PROBE["seed"])
    return {**PROBE, **measured}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nemo-tlt prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    p.add_argument("--rebuild", action="store_true", help="train into the cache even where shipped models match")
    p.add_argument("--ship", metavar="DIR", default=None,
                   help="write the three models as package data to DIR (manifest with checksums)")
    args = p.parse_args(argv)
    config = AssetConfig()
    assets = prepare_assets(config, args.cache_dir, shipped=not args.rebuild)
    for name, path in vars(assets).items():
        print(f"{name}: {path}")
    if args.ship:
        acceptance = probe_acceptance(assets)
        print(f"drafter acceptance probe: {acceptance}")
        extra = {"asset_config": asdict(config), "acceptance": acceptance,
                 "made_with": {"torch": torch.__version__, "python": platform.python_version(),
                               "command": "nemo-tlt prepare --rebuild --ship DIR"}}
        out = write_shipped({"target": assets.target_dir, "assistant": assets.assistant_dir,
                             "drafter": assets.drafter_dir}, args.ship, extra)
        print(f"shipped: {out}")
    return 0
