"""`nemo-tlt prepare`: train and cache the demo target, drafter and assistant."""
from __future__ import annotations

import argparse

from nemo_tlt.rl.assets import AssetConfig, default_cache_dir, prepare_assets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nemo-tlt prepare", description=__doc__)
    p.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    args = p.parse_args(argv)
    assets = prepare_assets(AssetConfig(), args.cache_dir)
    for name, path in vars(assets).items():
        print(f"{name}: {path}")
    return 0
