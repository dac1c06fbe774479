"""No hard-coded CPU device in the code that runs on a rank's device.

`tests/rl/test_device_guard.py` sets torch's default device to ``meta``: a tensor made
without ``device=`` fails there, but one made with ``device="cpu"`` lands on the host and
passes, because the configured device *is* the CPU here. On a GPU run it is a device
mismatch or a silent host round trip. So this test reads the source (ast) of the model,
the speculative functions, the drafters, the rollout engines, the policy backends, the
spot trainer and the RL loop and fails on every CPU device written into the code:

* a ``device="cpu"`` keyword (in a call, or as a parameter's default),
* ``torch.device("cpu")``,
* ``.cpu()``,
* ``.to("cpu", ...)`` / ``.to(device="cpu")``,

except where a host copy is the point, listed in ``ALLOWED`` by ``file:function`` with how
many such places that function may hold and why.
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "nemo_tlt"
PACKAGES = ("model", "speculative", "drafter", "rollout", "policy", "megatron", "spot", "rl", "algorithms")

ALLOWED: dict[str, tuple[int, str]] = {
    # "package/file.py:Qualified.function": (places, why the host is meant)
    "model/hf_io.py:save_hf_folder": (1, "safetensors writes host tensors"),
    "model/kv_cache.py:KVCache.__init__": (1, "a parameter default; the engine passes its device"),
    "drafter/io.py:save_drafter": (1, "safetensors writes host tensors"),
    "drafter/eagle3_hf.py:eagle3_hf_state": (1, "the export's tensors: safetensors writes host tensors, vLLM's "
                                                "reload copies from them"),
    "rollout/vllm_engine.py:VLLMRolloutEngine._payload": (1, "safetensors writes host tensors (refit file)"),
    "rollout/torch_engine.py:TorchRolloutEngine._prefill": (2, "prompts laid out on the host, one copy over"),
    "policy/batching.py:micro_batches": (5, "batches laid out on the host, one copy to `device`"),
    "policy/fixed_point.py:FixedPointGrads.__init__": (1, "only when there are no tensors to take it from"),
    "policy/megatron_backend.py:MegatronPolicy._all_logprobs": (1, "host scatter of log-probs into batch order"),
    "policy/megatron_forward.py:run_schedule": (1, "captured hidden states go to the host harvest buffer"),
    "megatron/ddp_optimizer.py:offload_training_state": (1, "the parameter buffer's host copy (offload)"),
    "megatron/parallel.py:compute_device": (1, "the rank's device where no GPU is present"),
    "megatron/pipeline_forward.py:causal_attention_mask": (1, "a parameter default; callers pass their device"),
    "spot/harvest.py:HarvestBuffer.sampling_weights": (2, "weights of a host-side sample choice"),
    "spot/harvest.py:_host": (1, "the harvest buffer lives on the host"),
    "spot/trainer.py:SpotTrainer.__init__": (1, "the batch-sampling generator draws host indices"),
    "spot/checkpoint.py:CheckpointManager.load": (1, "checkpoints load onto the host"),
    "spot/checkpoint.py:_host_copy": (1, "checkpoints are written from host copies"),
    "spot/averaging.py:average_replicas": (1, "only when there are no parameters"),
    "spot/averaging.py:_max_step": (1, "only when there are no parameters"),
    "spot/averaging.py:_set_step": (1, "Adam keeps a non-capturable step on the host"),
    "rl/update/sync_update.py:SyncUpdate.global_tokens": (1, "a gloo sum"),
    "rl/update/pipelined_step.py:PipelinedStep.finish": (1, "a gloo sum"),
    "algorithms/protocol.py:Outcomes.of": (1, "rewards and lengths are host values"),
    "rl/boundary.py:StepBoundary.decide": (1, "stop flags summed over gloo"),
    "rl/reporting/logprob_gap.py:gap_sums": (2, "a metric: one read to the host"),
    "rl/idle_drafter.py:IdleDrafter.sample": (1, "the harvest buffer lives on the host"),
    "rl/idle_drafter.py:IdleDrafter.restore": (1, "a torch.Generator state is a host byte tensor"),
    "rl/weight_stream.py:_bytes": (1, "bytes for the wire"),
    "rl/state/sharded_run_checkpoint.py:_write_run_part": (1, "safetensors writes host tensors"),
}


def _is_cpu(node: ast.AST) -> bool:
    """``"cpu"`` or ``torch.device("cpu")``."""
    if isinstance(node, ast.Constant) and node.value == "cpu":
        return True
    return (isinstance(node, ast.Call) and _name(node.func) in ("torch.device", "device") and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "cpu")


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.hits: list[tuple[str, int, str]] = []  # (qualified function, line, what)

    def _hit(self, node: ast.AST, what: str) -> None:
        self.hits.append((".".join(self.scope) or "<module>", node.lineno, what))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _scoped

    def visit_FunctionDef(self, node) -> None:
        args = node.args
        named = args.posonlyargs + args.args
        defaults = list(zip(named[len(named) - len(args.defaults):], args.defaults))
        defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        self.scope.append(node.name)
        for arg, default in defaults:
            if arg.arg == "device" and _is_cpu(default) and isinstance(default, ast.Constant):
                self._hit(default, 'device="cpu" default')
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        # torch.device("cpu") is one hit wherever it is written (its own Call), so the
        # forms below count only a literal "cpu"
        func = node.func
        if _is_cpu(node):
            self._hit(node, 'torch.device("cpu")')
        elif isinstance(func, ast.Attribute) and func.attr == "cpu" and not node.args:
            self._hit(node, ".cpu()")
        elif (isinstance(func, ast.Attribute) and func.attr == "to" and node.args
              and isinstance(node.args[0], ast.Constant) and _is_cpu(node.args[0])):
            self._hit(node, '.to("cpu")')
        for kw in node.keywords:
            if kw.arg == "device" and isinstance(kw.value, ast.Constant) and _is_cpu(kw.value):
                self._hit(kw.value, 'device="cpu"')
        self.generic_visit(node)


def cpu_devices(source: str) -> list[tuple[str, int, str]]:
    """Every hard-coded CPU device in ``source``: (qualified function, line, what)."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.hits


def _scanned() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_hard_coded_cpu_device_outside_the_allow_list():
    found: Counter = Counter()
    where: dict[str, list[str]] = {}
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        for func, line, what in cpu_devices(path.read_text()):
            key = f"{rel}:{func}"
            found[key] += 1
            where.setdefault(key, []).append(f"{rel}:{line} ({func}) {what}")
    unlisted = [w for key, n in found.items() if n > ALLOWED.get(key, (0, ""))[0] for w in where[key]]
    assert not unlisted, ("hard-coded CPU device (pass the rank's device, or add file:function to ALLOWED with "
                          "the reason a host copy is meant):\n" + "\n".join(unlisted))
    # an entry names exactly the places it allows: one gone (or a function renamed) updates the list
    stale = {key: found[key] for key, (n, _) in ALLOWED.items() if found[key] != n}
    assert not stale, f"ALLOWED entries that no longer match the code (places found now): {stale}"


@pytest.mark.parametrize("snippet,what", [
    ("def f(x):\n    return torch.zeros(3, device='cpu')\n", 'device="cpu"'),
    ("def f(x):\n    return x.to(torch.device('cpu'))\n", 'torch.device("cpu")'),
    ("def f(x):\n    return x.cpu()\n", ".cpu()"),
    ("def f(x):\n    return x.to('cpu', torch.float32)\n", '.to("cpu")'),
    ("def f(x, device='cpu'):\n    return x\n", 'device="cpu" default'),
    ("class E:\n    def step(self, x):\n        return torch.tensor([1], device=torch.device('cpu'))\n",
     'torch.device("cpu")'),
])
def test_the_finder_sees_each_form(snippet, what):
    hits = cpu_devices(snippet)
    assert what in {w for _, _, w in hits}, hits
    assert all(func in ("f", "E.step") for func, _, _ in hits), hits


def test_the_finder_leaves_configured_devices_alone():
    src = ("def f(x, device):\n    y = torch.zeros(3, device=device)\n    z = x.to(device)\n"
           "    return torch.device('cuda', 0), x.to(dtype=torch.float32), y, z\n")
    assert cpu_devices(src) == []
