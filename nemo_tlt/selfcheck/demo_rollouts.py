"""What the engine selfchecks share: the demo's task prompts, one timed greedy rollout, and
``pytest -m <marker>`` run as a user runs it, judged by its summary line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^=+ (.*(passed|failed|skipped|error|no tests ran).*) =+$")


def demo_prompts(num: int) -> list[list[int]]:
    """``num`` demo task prompts as token ids (the same every call)."""
    from nemo_tlt.demo.assets import AssetConfig, task_requests

    _, reqs = task_requests(AssetConfig().task, num, seed=20_000)
    return [list(r.prompt) for r in reqs]


def greedy(engine, prompts: list[list[int]], max_new: int, policy) -> tuple[list[list[int]], Any, float]:
    """(tokens per prompt, the call's stats, its seconds) of one greedy ``generate``."""
    from nemo_tlt.rollout.protocol import Request
    from nemo_tlt.speculative.sampling import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate([Request(p, seq_id=i) for i, p in enumerate(prompts)],
                          SamplingParams("greedy", max_new_tokens=max_new), policy=policy)
    return [r.tokens for r in out.results], out.stats, time.perf_counter() - t0


def pytest_summary(output: str) -> str | None:
    """pytest's last summary line (``== 3 passed, 1 skipped in 4.2s ==``), without the rules."""
    lines = [SUMMARY.match(line.strip()) for line in output.splitlines()]
    found = [m.group(1) for m in lines if m]
    return found[-1] if found else None


def pytest_marked(marker: str, timeout_s: float | None = None,
                  run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> dict[str, Any]:
    """``pytest -m <marker>`` over the conformance suite and the engines' tests; an
    AssertionError unless it exits 0 with tests passed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", marker, "tests/conformance", "tests/rollout"]
    done = run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=timeout_s,
               env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = pytest_summary(done.stdout)
    result = {"command": " ".join(["pytest", *cmd[3:]]), "exit_status": done.returncode, "summary": summary}
    if done.returncode != 0 or summary is None or "passed" not in summary:
        raise AssertionError(f"{result['command']}: exit {done.returncode}, {summary!r}\n{done.stdout[-3000:]}"
                             f"{done.stderr[-1000:]}")
    return result


def sd_throughput(methods: dict[str, tuple[Any, Any]], prompts: list[list[int]], batch_sizes: tuple[int, ...],
                  max_new: int) -> list[dict[str, Any]]:
    """Greedy tokens/s of ``methods`` ({"sd": (engine, policy), "plain": (engine, None)}) per batch
    size over the first prompts, each timed once after an untimed warm-up, the order reversed
    every other batch size; ``sd_vs_plain`` the ratio."""
    rows = []
    for i, batch in enumerate(batch_sizes):
        names = list(methods)[:: 1 if i % 2 == 0 else -1]
        row: dict[str, Any] = {"batch": batch, "order": names}
        for name in names:
            engine, policy = methods[name]
            greedy(engine, prompts[:batch], max_new, policy)  # warm-up, not timed
            tokens, stats, seconds = greedy(engine, prompts[:batch], max_new, policy)
            row[f"{name}_tokens_per_s"] = sum(map(len, tokens)) / seconds
            if name == "sd":
                row["sd_mean_accept_len"] = stats.mean_accept_len
        row["sd_vs_plain"] = row["sd_tokens_per_s"] / row["plain_tokens_per_s"]
        rows.append(row)
    return rows
