"""Shared benchmark plumbing: machine facts and a plain-text table (JSON output: nemo_tlt.atomic.write_json_atomic)."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
from typing import Any

import torch

from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.model.config import LMConfig


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }


def format_table(rows: dict[str, dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    header = ["method"] + columns
    body = [[name] + [fmt(r.get(c, "")) for c in columns] for name, r in rows.items()]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def megatron_bench_refusal(name: str, trials: int | None = None) -> str | None:
    """Why a megatron benchmark cannot run (megatron-core missing, ``--trials`` < 1), or None."""
    from nemo_tlt.megatron import require_megatron_core

    try:
        require_megatron_core(f"nemo-tlt bench {name}")
    except RuntimeError as err:
        return str(err)
    if trials is not None and trials < 1:
        return f"--trials must be >= 1, got {trials}"
    return None


def add_model_shape(p: argparse.ArgumentParser, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                    vocab: int = 32000) -> None:
    """The random Llama-shaped model a benchmark builds: ``--hidden``, ``--layers``, ``--heads``,
    ``--kv-heads``, ``--ffn``, ``--vocab`` with the benchmark's defaults (``model_config`` reads them)."""
    for flag, default in (("--hidden", hidden), ("--layers", layers), ("--heads", heads), ("--kv-heads", kv_heads),
                          ("--ffn", ffn), ("--vocab", vocab)):
        p.add_argument(flag, type=int, default=default)


def model_config(args: argparse.Namespace, **fields: Any) -> LMConfig:
    """The ``LMConfig`` of ``add_model_shape``'s arguments (Llama family), plus ``fields``."""
    return LMConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                    num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, **fields)


def add_start_method(p: argparse.ArgumentParser) -> None:
    """``--start-method``: how the benchmark's local ranks start. ``spawn`` (the default, and what
    the recorded figures use) gives each rank a fresh interpreter; ``fork`` (CPU only) lets them
    inherit this process's imports, so four ranks that use megatron-core start in a fraction of a
    second instead of about 10 s on a 2-core machine: for smoke runs, whose figures are not kept."""
    p.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                   help="how local ranks start (fork: CPU only, for quick smoke runs)")


def write_summary(summary: dict[str, Any], out: str, ok: bool) -> int:
    """Write ``summary`` to ``out`` (atomic JSON), print it, and return the exit status: 0 when
    ``ok`` (the benchmark's targets held), else 1."""
    write_json_atomic(out, summary)
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1
