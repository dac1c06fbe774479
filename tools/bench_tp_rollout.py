"""Rollout engine timing: this tree's engine without TP against another tree's (the
TP code must cost nothing at tp=None), and this tree's engine at TP 2 against TP 1.

    python tools/bench_tp_rollout.py --baseline-src DIR --out bench_tp_rollout.json

``DIR`` holds another checkout of the package (e.g. ``git archive main | tar -x -C DIR``).
Methods, each a fresh process on the demo target and EAGLE drafter (greedy, the
prompts below, plain decoding and a fixed 4_2_6 tree), timed as the median of
``--repeats`` generate calls after one warm-up:

* ``baseline``: the engine of ``DIR``; ``control``: the same again (the noise);
* ``tp1``: this tree's engine (tp=None);
* ``tp2``: this tree's engine at TP 2 on two gloo ranks (rank 0's times).

Rounds run the methods in alternating order (forward, then reversed). The JSON holds
every trial's medians, the median over trials per method, and ratios to ``baseline``.
Set ``OMP_NUM_THREADS=1`` (each process runs one intra-op thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ("3+5-2+7=", "sort:3,1,2=", "a:baac=", "8+1+1-5+3-2=", "9-4+1+6=", "b:abba=", "sort:5,2,8,1=",
           "1+1+1+1-3=")
METHODS = ("baseline", "tp1", "tp2", "control")

# Runs in the child, with PYTHONPATH set to the tree under test.
CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

PROMPTS, REPEATS, TP, NEW = json.loads(sys.argv[1])


def timed(tp):
    kw = {} if tp is None else {"tp": tp}
    engine = TorchRolloutEngine.from_hf_folder(SHIPPED_DIR / "target", load_drafter(SHIPPED_DIR / "drafter"), **kw)
    tok = CharTokenizer()
    reqs = [Request(tuple(tok.encode(p, add_bos=True))) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=NEW)
    out = {}
    for name, policy in (("plain", None), ("sd", FixedSDPolicy(TreeShape(4, 2, 6)))):
        engine.generate(reqs, sampling, policy=policy)
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            engine.generate(reqs, sampling, policy=policy)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def rank(ctx):
    import torch.distributed as dist
    from nemo_tlt.model.tensor_parallel import TensorParallel
    return timed(TensorParallel.of_group(dist.group.WORLD))


if __name__ == "__main__":
    if TP == 1:
        result = timed(None)
    else:
        from nemo_tlt.dist import launch_local
        result = launch_local(rank, TP, timeout_s=600)[0]
    print(json.dumps(result))
"""


def run(src: Path, tp: int, repeats: int, new: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "bench_tp_child.py"  # a file: the TP ranks are spawned and re-import it
        script.write_text(CHILD)
        out = subprocess.run([sys.executable, str(script), json.dumps([PROMPTS, repeats, tp, new])], env=env,
                             cwd=tmp, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    where = {"baseline": (args.baseline_src.resolve(), 1), "control": (args.baseline_src.resolve(), 1),
             "tp1": (here, 1), "tp2": (here, 2)}
    trials: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
            trials[m].append(run(*where[m], args.repeats, args.max_new_tokens))
            print(m, trials[m][-1], flush=True)
    med = {m: {k: statistics.median(t[k] for t in trials[m]) for k in ("plain", "sd")} for m in METHODS}
    ratios = {m: {k: med[m][k] / med["baseline"][k] for k in ("plain", "sd")} for m in METHODS}
    summary = {"prompts": len(PROMPTS), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
               "repeats": args.repeats, "trials_s": trials, "median_s": med, "ratio_to_baseline": ratios}
    args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
