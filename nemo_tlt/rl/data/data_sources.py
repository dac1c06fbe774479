"""Prompts from local files read with Hugging Face ``datasets`` (``task.source: datasets``).

Contract: a json, jsonl or parquet file on disk (nothing is downloaded) becomes a
:class:`~nemo_tlt.rl.data.prompts.TaskSource`. Column mapping: ``prompt_key`` names the column
of prompt texts (non-empty strings), ``answer_key`` the optional column of reference
answers (a scalar; numbers and booleans become their JSON text, null means none); the
other columns go to ``Prompt.meta``. Rows are read once, at construction; each step's
rows follow ``order`` / ``shuffle_seed`` as for the JSONL source
(:func:`~nemo_tlt.rl.data.prompts.draw_rows`). Errors name the file, the row and the column.
Needs the ``datasets`` extra (``pip install 'nemo-tlt[datasets]'``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nemo_tlt.rl.data.prompts import Prompt, check_order, draw_rows, prompt_from_record

# file suffix -> the datasets builder that reads it
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _load_rows(path: Path, fmt: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("task.source='datasets' needs the datasets package: pip install 'nemo-tlt[datasets]' "
                          f"[{err}]") from err
    try:
        table = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as err:
        raise ValueError(f"DatasetsTaskSource: cannot read {path} as {fmt} ({err})") from None
    return table.to_list()


class DatasetsTaskSource:
    """Prompts from a local ``datasets`` file (see the module docstring).

    ``format``: ``json`` (JSON lines or a JSON array of objects) or ``parquet``; unset,
    it follows the suffix (.json, .jsonl, .parquet)."""

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 format: str | None = None, order: str = "epochs", shuffle_seed: int = 0) -> None:
        check_order(order, shuffle_seed, "DatasetsTaskSource")
        self.path, self.order, self.shuffle_seed = Path(path), order, shuffle_seed
        if not self.path.is_file():
            raise ValueError(f"task.options.path: {self.path} is not a file (task.source='datasets' reads local "
                             "json / jsonl / parquet files)")
        fmt = format or FORMATS.get(self.path.suffix.lower())
        if fmt not in set(FORMATS.values()):
            raise ValueError(f"task.options.format must be one of {sorted(set(FORMATS.values()))} (or unset for a "
                             f"file ending in {sorted(FORMATS)}), got {format!r} for {self.path}")
        rows = _load_rows(self.path, fmt)
        if not rows:
            raise ValueError(f"DatasetsTaskSource: {self.path} holds no rows")
        if prompt_key not in rows[0]:
            raise ValueError(f"{self.path}: no column {prompt_key!r} (task.options.prompt_key, the prompt text); "
                             f"columns: {sorted(rows[0])}")
        self.rows: tuple[Prompt, ...] = tuple(self._row(i, r, prompt_key, answer_key) for i, r in enumerate(rows))

    def _row(self, index: int, row: dict[str, Any], prompt_key: str, answer_key: str) -> Prompt:
        return prompt_from_record(row, prompt_key, answer_key, f"{self.path}: row {index}", "column", "a scalar")

    def __len__(self) -> int:
        return len(self.rows)

    def prompts(self, step: int, n: int, rng: np.random.Generator) -> list[Prompt]:
        picks = draw_rows(len(self.rows), step, n, rng, self.order, self.shuffle_seed, "DatasetsTaskSource")
        return [self.rows[i] for i in picks]
