"""Whole-system checks of the GPU acceptance run, each on a given device kind.

* ``main_job_check``: ``nemo-tlt train conf/demo.yaml --compare-baseline`` on one worker
  of that device (a subprocess, as a user runs it); its speedup, control ratio and
  whether rewards were identical, from the run's ``report.json``; with
  ``require_identical`` (for a run in fp32 arithmetic) it fails when TLT and baseline
  give different rollouts or rewards.
* ``megatron_check``: the megatron-core policy backend at world size 1 (NCCL on CUDA,
  gloo on CPU) and the torch backend take one update on the same batch from the same
  weights; their loss, gradient norm and updated weights agree.
* ``checkpoint_check``: a run checkpoint whose weights and optimizer state live on the
  device is written, read back and equal, bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"


def main_job_check(device_kind: str, out_dir: Path, overrides: tuple[str, ...] = (), pairs: int = 1,
                   require_identical: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
    if not DEMO_CONFIG.is_file():
        raise FileNotFoundError(f"{DEMO_CONFIG}: the demo config (selfcheck runs from a checkout of the repository)")
    cmd = [sys.executable, "-m", "nemo_tlt.cli", "train", str(DEMO_CONFIG), "--compare-baseline", "--pairs",
           str(pairs), "workers.num_workers=1", f"workers.device={device_kind}", f"run_dir={out_dir}",
           "progress=false", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {done.returncode}:\n{done.stderr[-4000:]}")
    report = json.loads((out_dir / "report.json").read_text())
    config = (out_dir / "config.yaml").read_text()
    if require_identical and not (report["rewards_identical"] and report.get("rollouts_identical", True)):
        raise AssertionError(f"TLT and baseline rollouts or rewards differ in an fp32-arithmetic run (coupled "
                             f"sampling promises them identical): rewards_identical={report['rewards_identical']}, "
                             f"rollouts_identical={report.get('rollouts_identical')}")
    return {"command": " ".join(["nemo-tlt", *cmd[4:]]), "speedup": report["speedup"],
            "control_ratio": report["control_ratio"], "rewards_identical": report["rewards_identical"],
            "rollouts_identical": report.get("rollouts_identical"), "noisy": report["noisy"],
            "config_device_line": next((ln.strip() for ln in config.splitlines() if ln.strip().startswith("device:")),
                                       None)}


def _megatron_worker(ctx, canonical: dict, cfg, batch: list, advantages: torch.Tensor) -> dict[str, Any]:
    from nemo_tlt.device import Placement
    from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend

    placement = Placement(ctx.device, torch.float32)
    tokens = sum(len(r) for _, r in batch)
    out = {}
    for backend in ("torch", "megatron"):
        policy = build_policy_backend(PolicyConfig(backend=backend, micro_batch=4, optim=PolicyOptimConfig(lr=1e-3)),
                                      canonical, cfg, temperature=1.0, seed=0, placement=placement)
        stats = policy.update(batch, advantages, None, None, tokens)
        weights = {k: v.detach().float().cpu() for k, v in policy.canonical_weights()}
        out[backend] = {"stats": stats, "weights": weights}
    return out


def megatron_check(device_kind: str, cfg, tolerance: float = 1e-4) -> dict[str, Any]:
    from nemo_tlt.dist import launch_local
    from nemo_tlt.model.lm import DecoderLM

    gen = torch.Generator().manual_seed(3)
    canonical = DecoderLM(cfg).init_weights_(gen).state_dict()
    batch = [(torch.randint(3, cfg.vocab_size, (4,), generator=gen).tolist(),
              torch.randint(3, cfg.vocab_size, (int(n),), generator=gen).tolist())
             for n in torch.randint(2, 12, (6,), generator=gen)]
    advantages = torch.randn(6, generator=gen)
    got = launch_local(_megatron_worker, 1, canonical, cfg, batch, advantages, device=device_kind,
                       hide_cuda=device_kind == "cpu", timeout_s=None)[0]
    a, b = got["torch"], got["megatron"]
    diffs = {k: abs(a["stats"][k] - b["stats"][k]) for k in ("loss", "grad_norm")}
    weight_diff = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
    ok = max(diffs.values()) <= tolerance * max(1.0, a["stats"]["grad_norm"]) and weight_diff <= tolerance
    if not ok:
        raise AssertionError(f"megatron and torch backends disagree: {diffs}, max weight difference {weight_diff}")
    return {"loss": b["stats"]["loss"], "grad_norm": b["stats"]["grad_norm"], "abs_diff": diffs,
            "max_weight_diff": weight_diff, "tolerance": tolerance}


def checkpoint_check(device: torch.device, folder: Path) -> dict[str, Any]:
    from nemo_tlt.rl.reporting.records import RankState
    from nemo_tlt.rl.state.run_checkpoint import RunCheckpointer, RunState

    gen = torch.Generator().manual_seed(5)
    weights = {f"w{i}": torch.randn(64, 32, generator=gen).to(device, torch.bfloat16) for i in range(3)}
    params = [torch.nn.Parameter(torch.randn(8, generator=gen).to(device)) for _ in range(2)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    opt.step()
    state = RunState(step=0, mode="baseline", world=1, policy_weights=weights,
                     policy_states=[{"optimizer": opt.state_dict(), "step": 1}], ranks=[RankState(None, None)],
                     records=[{"step": 0}])
    writer = RunCheckpointer(folder, keep_last=1, writer=True)
    writer.save(state)
    writer.close()
    back = RunCheckpointer(folder).load_latest(1, "baseline")
    if back is None:
        raise AssertionError(f"{folder}: the checkpoint just written was not found")
    same = all(torch.equal(back.policy_weights[k], weights[k].cpu()) for k in weights)
    restored = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    restored.load_state_dict(back.policy_states[0]["optimizer"])
    got, want = restored.state_dict()["state"], opt.state_dict()["state"]
    moments = all(torch.equal(got[i][k], want[i][k]) for i in want for k in ("exp_avg", "exp_avg_sq"))
    if not (same and moments):
        raise AssertionError(f"checkpoint round trip on {device}: weights equal {same}, Adam moments equal {moments}")
    return {"weights_equal": same, "optimizer_state_equal": moments,
            "optimizer_state_device": str(got[0]["exp_avg"].device)}
