"""``nemo-tlt selfcheck --gpu --out F.json``: the GPU acceptance run, one command, one JSON.

On one GPU with no network (torch, this repository and the wheels it names), it runs in
order (sizes in ``GPU_SIZES``; the estimated seconds of each check, ``BUDGET_S``, and their
sum are printed at the start: an estimate for one H100, not a measurement):

1. ``engine_demo_float32`` / ``engine_demo_bfloat16`` / ``..._bfloat16_compute_float32``: the
   embedded engine on ``cuda:0`` with the shipped (trained) demo target and drafter, SD's
   token identity to plain decoding asserted in fp32 arithmetic (``selfcheck.engine_check``);
2. ``sdpa_probe``, ``decode_cost``, ``verify_vs_decode``, ``batch_invariance``,
   ``weight_sync``: a random model shaped like Qwen2.5-7B in bf16 (the dry run: a toy one in fp32): the attention kernels of
   prefill, decode and verify; ms per decode step and peak memory at batch 64 and 128 with
   1k prompt + 1k output beside the bytes-over-bandwidth roofline; logit differences,
   recorded, not asserted; a full weight stream (``selfcheck.kernel_checks``);
3. ``main_job``: the demo main job on one GPU worker with its speedup;
4. ``megatron_world1``: the megatron backend at world size 1 over NCCL against the torch
   backend;
5. ``checkpoint_roundtrip``: a run checkpoint of CUDA tensors written and read back.

Each check is recorded as ``passed`` (with its figures) or ``failed`` (with the error) and
the JSON is rewritten after every check, so a run cut short keeps what it measured. Exit
status: 0 all passed, 1 a check failed, 2 bad usage or no CUDA device (nothing run).

``--cpu-dry-run`` runs the same checks on the CPU at toy sizes (``DRY_RUN_SIZES``): it
shows the code paths work, says nothing about a GPU, and its JSON says so.

``--trtllm`` (beside ``--gpu``; ``selfcheck.trtllm_check``) runs the TensorRT-LLM engine on
the demo target with the trained demo EAGLE-3 drafter exported: greedy token identity
against the torch engine, per-step acceptance, tokens/s with and without the drafter, and
``pytest -m trtllm``; same JSON and exit statuses (2: no tensorrt_llm or no CUDA device,
nothing run). NEVER RUN yet.

``--vllm`` (``selfcheck.vllm_check``) runs the vLLM engine with the shipped EAGLE-3 drafter of
the demo target on ``cuda:0``, or on the CPU where CUDA is not available (vLLM's CPU build):
greedy identity against vLLM plain, acceptance, tokens/s, sleep mode (CUDA), and ``pytest -m
vllm``; same JSON and exit statuses (2: no vllm package, nothing run).
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.model.config import LMConfig
from nemo_tlt.selfcheck import engine_check as ec
from nemo_tlt.selfcheck import kernel_checks as kc
from nemo_tlt.selfcheck import system_checks as sc
from nemo_tlt.selfcheck import trtllm_check as tc
from nemo_tlt.selfcheck import vllm_check as vc


@dataclasses.dataclass(frozen=True)
class Sizes:
    demo_prompts: int
    demo_max_new: int
    batch_sizes: tuple[int, ...]
    kernel_model: LMConfig           # the random model of the kernel checks
    kernel_dtype: torch.dtype        # ... and its dtype
    prompt_len: int                  # decode_cost, verify_vs_decode, batch_invariance
    decode_batches: tuple[int, ...]
    decode_max_new: int
    decode_warm: int                 # decode_cost: steps subtracted (prefill drops out)
    invariance_batch: int
    bandwidth_gib: float             # the copy that measures the device's bandwidth
    main_job_overrides: tuple[str, ...]
    megatron_model: LMConfig


GPU_SIZES = Sizes(demo_prompts=32, demo_max_new=400, batch_sizes=(1, 32), kernel_model=kc.QWEN25_7B,
                  kernel_dtype=torch.bfloat16,
                  prompt_len=1024, decode_batches=(64, 128), decode_max_new=1024, decode_warm=16,
                  invariance_batch=64, bandwidth_gib=2.0, main_job_overrides=(),
                  megatron_model=LMConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=4,
                                          num_heads=8, num_kv_heads=4))
DRY_RUN_SIZES = Sizes(demo_prompts=4, demo_max_new=24, batch_sizes=(1, 4),
                      kernel_model=LMConfig(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0),
                      kernel_dtype=torch.float32, prompt_len=32, decode_batches=(2, 4), decode_max_new=24, decode_warm=8, invariance_batch=4,
                      bandwidth_gib=0.01,
                      main_job_overrides=("steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
                                          "grpo.max_new_tokens=48"),
                      megatron_model=LMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                              num_heads=4, num_kv_heads=2))
# Estimated seconds of each --gpu check on one H100 (not measured: no GPU run of these sizes yet),
# printed with their sum at the start so that a run is planned within a 10-minute slot.
BUDGET_S = {"engine_demo_float32": 40, "engine_demo_bfloat16": 40, "engine_demo_bfloat16_compute_float32": 20,
            "kv_fraction": 15,
            "sdpa_probe": 15, "decode_cost": 150, "verify_vs_decode": 25, "batch_invariance": 30,
            "weight_sync": 30, "main_job": 120, "megatron_world1": 30, "checkpoint_roundtrip": 10}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nemo-tlt selfcheck", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu", action="store_true", help="the GPU acceptance run on cuda:0")
    mode.add_argument("--cpu-dry-run", action="store_true", help="the same checks on the CPU at toy sizes")
    mode.add_argument("--trtllm", action="store_true",
                      help="the TensorRT-LLM engine with the trained demo EAGLE-3 drafter, and pytest -m trtllm")
    mode.add_argument("--vllm", action="store_true",
                      help="the vLLM engine with the shipped demo EAGLE-3 drafter (cuda:0, else the CPU), and "
                           "pytest -m vllm")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--only", default=None, help="comma-separated check names to run (default: all)")
    p.add_argument("--cache-dir", default=None, help="where the demo assets are cached ($NEMO_TLT_CACHE)")
    return p.parse_args(argv)


def plan(device: torch.device, sizes: Sizes, work: Path, cache_dir: str | None) -> dict[str, Callable[[], Any]]:
    """Check name -> zero-argument function returning its figures (raising when it fails)."""
    kind = device.type
    checks: dict[str, Callable[[], Any]] = {}
    demo = lambda: ec.demo_case(sizes.demo_prompts, sizes.demo_max_new, cache_dir)  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        checks[f"engine_demo_{str(dtype).removeprefix('torch.')}"] = (
            lambda dtype=dtype: ec.engine_check(demo(), device, dtype, sizes.batch_sizes))
    checks["engine_demo_bfloat16_compute_float32"] = (  # rollout.compute_dtype=float32: identity again
        lambda: ec.engine_check(demo(), device, torch.bfloat16, sizes.batch_sizes[:1], with_hf=False,
                                compute_dtype=torch.float32))
    checks["kv_fraction"] = lambda: ec.kv_fraction_check(demo(), device)
    m, dt, n = sizes.kernel_model, sizes.kernel_dtype, sizes.prompt_len
    checks["sdpa_probe"] = lambda: kc.sdpa_probe(m, device, dt, n)
    checks["decode_cost"] = lambda: kc.decode_cost(m, device, dt, sizes.decode_batches, n, sizes.decode_max_new,
                                                   sizes.decode_warm, sizes.bandwidth_gib)
    checks["verify_vs_decode"] = lambda: kc.verify_vs_decode(m, device, dt, n, chain=8)
    checks["batch_invariance"] = lambda: kc.batch_invariance(m, device, dt, n, sizes.invariance_batch)
    checks["weight_sync"] = lambda: kc.weight_sync(m, device, dt)
    checks["main_job"] = lambda: sc.main_job_check(kind, work / "main_job", sizes.main_job_overrides)
    checks["megatron_world1"] = lambda: sc.megatron_check(kind, sizes.megatron_model)
    checks["checkpoint_roundtrip"] = lambda: sc.checkpoint_check(device, work / "checkpoint")
    return checks


def environment(device: torch.device) -> dict[str, Any]:
    env = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "python": platform.python_version(),
           "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def trtllm_refusal() -> str | None:
    """Why ``--trtllm`` cannot run here (None: it can): TensorRT-LLM or a CUDA device missing."""
    from nemo_tlt.rollout.trtllm_config import missing_package_message, tensorrt_llm_installed

    reasons = []
    if not tensorrt_llm_installed():
        reasons.append(missing_package_message("nemo-tlt selfcheck --trtllm"))
    if not torch.cuda.is_available():
        reasons.append(f"no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if not reasons:
        return None
    return "nemo-tlt selfcheck --trtllm: nothing was run.\n" + "\n".join(f"  - {r}" for r in reasons)


def vllm_refusal() -> str | None:
    """Why ``--vllm`` cannot run here (None: it can): the vllm package missing."""
    from nemo_tlt.rollout.vllm_config import missing_package_message, vllm_installed

    if vllm_installed():
        return None
    return "nemo-tlt selfcheck --vllm: nothing was run.\n  - " + missing_package_message("nemo-tlt selfcheck --vllm")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    refusal = trtllm_refusal() if args.trtllm else vllm_refusal() if args.vllm else None
    if refusal is not None:
        print(refusal)
        return 2
    if args.gpu and not torch.cuda.is_available():
        print(f"nemo-tlt selfcheck --gpu: no CUDA device here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); nothing was run. Run it on a GPU node, or --cpu-dry-run to exercise "
              "the checks on the CPU.")
        return 2
    on_gpu = args.gpu or args.trtllm or (args.vllm and torch.cuda.is_available())
    device, sizes = (torch.device("cuda", 0), GPU_SIZES) if on_gpu else (torch.device("cpu"), DRY_RUN_SIZES)
    out = Path(args.out)
    with ec.scratch_folder() as tmp:
        checks = (tc.trtllm_plan(Path(tmp), args.cache_dir) if args.trtllm else vc.vllm_plan(Path(tmp)) if args.vllm
                  else plan(device, sizes, Path(tmp), args.cache_dir))
        wanted = list(checks) if args.only is None else [c.strip() for c in args.only.split(",")]
        unknown = [c for c in wanted if c not in checks]
        if unknown:
            print(f"nemo-tlt selfcheck: --only names unknown checks {unknown}; known: {list(checks)}")
            return 2
        mode = "trtllm" if args.trtllm else "vllm" if args.vllm else "gpu" if args.gpu else "cpu_dry_run"
        extra = tc.trtllm_environment() if args.trtllm else vc.vllm_environment() if args.vllm else {}
        env = {**environment(device), **extra}
        report: dict[str, Any] = {"mode": mode, "environment": env, "checks": {}}
        if args.gpu:
            budget = {name: BUDGET_S[name] for name in wanted}
            report["budget_s"] = budget
            print(f"selfcheck: budget {sum(budget.values())} s estimated for one H100 (not measured): {budget}",
                  flush=True)
        if args.vllm and not on_gpu:
            report["note"] = "vLLM's CPU build on the CPU: it says nothing about a GPU"
        elif not on_gpu:
            report["note"] = "a dry run on the CPU at toy sizes: it says nothing about a GPU"
        for name in wanted:
            print(f"selfcheck: {name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                entry = {"status": "passed", "result": checks[name]()}
            except Exception as err:  # recorded, and the run goes on to the next check; exit status 1
                entry = {"status": "failed", "error": f"{type(err).__name__}: {err}",
                         "traceback": traceback.format_exc()[-4000:]}
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            report["checks"][name] = entry
            write_json_atomic(out, report)
            print(f"selfcheck: {name} {entry['status']} in {entry['seconds']:.1f}s", flush=True)
    failed = [n for n, e in report["checks"].items() if e["status"] != "passed"]
    report["passed"] = not failed
    write_json_atomic(out, report)
    print(f"selfcheck: {len(wanted) - len(failed)} passed, {len(failed)} failed; wrote {out}")
    return 1 if failed else 0
