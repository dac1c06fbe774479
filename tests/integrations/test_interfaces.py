"""The adapters held to the real interfaces as recorded in
``nemo_tlt.integrations.interface_facts`` (NeMo-RL's GenerationInterface and its output
spec, NeMo-Aligner's GPTGenerateTRTLLM as its actors call it): every abstract or called
method present with a signature that accepts the real calls, every output key present with
the real dtype and shape. The second half checks that the checks catch drift."""
from __future__ import annotations

import re
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from omegaconf import OmegaConf

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.integrations.interface_facts import (KEYWORD_ONLY, NEMO_ALIGNER_GENERATE, NEMO_RL_GENERATION,
                                                   Method, Param, interface_deviations, output_deviations,
                                                   signature_deviations)
from nemo_tlt.integrations.nemo_aligner import TLTBlock, TLTGenerateBackend, read_aligner_config
from nemo_tlt.integrations.nemo_rl import TLTGeneration
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.rollout.trtllm_config import TRTLLM_INSTALL
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
import nemo_rl_sender
import trtllm_standin
from test_nemo_face import aligner_yaml
from tiny import tiny_target


def nemo_rl_adapter(seed: int = 3) -> TLTGeneration:
    return TLTGeneration(TorchRolloutEngine(tiny_target(seed=seed)), SamplingParams(mode="rejection", max_new_tokens=5),
                         pad_token_id=0)


DATUM = {"input_ids": torch.tensor([[3, 4, 0], [5, 6, 7]]), "input_lengths": torch.tensor([2, 3])}


def test_nemo_rl_adapter_meets_generation_interface():
    assert interface_deviations(nemo_rl_adapter(), NEMO_RL_GENERATION) == []


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
@pytest.mark.parametrize("greedy", [True, False])
def test_nemo_rl_output_spec_keys_dtypes_shapes(dtype, greedy):
    data = {k: v.to(dtype) if k == "input_ids" else v for k, v in DATUM.items()}
    out = nemo_rl_adapter().generate(data, greedy)
    sizes = {"B": 2, "S": int(out["unpadded_sequence_lengths"].max())}
    assert output_deviations(out, NEMO_RL_GENERATION.outputs, sizes, data) == []
    for b, (P, n) in enumerate(zip(data["input_lengths"].tolist(), out["unpadded_sequence_lengths"].tolist())):
        assert (out["logprobs"][b, P:n] < 0).all() and not out["logprobs"][b, :P].any()
        assert not out["logprobs"][b, n:].any()  # zeros over the prompt and the padding


def test_nemo_rl_stop_strings_are_refused_by_name():
    with pytest.raises(ValueError, match="stop_strings"):
        nemo_rl_adapter().generate({**DATUM, "stop_strings": [["\n"], None]}, True)
    nemo_rl_adapter().generate({**DATUM, "stop_strings": [None, None]}, True)


def test_nemo_rl_adapter_selects_the_engine_from_the_tlt_block(tmp_path):
    folder = save_hf_folder(tiny_target(seed=3), tmp_path / "t")
    gen = TLTGeneration.from_tlt_block(TLTBlock(target_dir=str(folder)), SamplingParams(mode="rejection"), 0)
    assert isinstance(gen.engine, TorchRolloutEngine)
    trt = TLTBlock(backend="trtllm", target_dir=str(folder))
    with pytest.raises(ImportError, match=re.escape(TRTLLM_INSTALL)):
        TLTGeneration.from_tlt_block(trt, SamplingParams(mode="rejection"), 0)


def _ipc_adapter(tlt, monkeypatch) -> TLTGeneration:
    """The adapter as a colocated NeMo-RL run drives it, its socket named by a fresh UUID."""
    uuid = f"GPU-test-{uuid4()}"
    gen = TLTGeneration.from_tlt_block(tlt, SamplingParams(mode="rejection", max_new_tokens=8), pad_token_id=0,
                                       device_uuid=uuid, rebuild=nemo_rl_sender.rebuild_cpu)
    gen.uuid = uuid
    return gen


def _refit(gen, tensors, **kwargs):
    """One colocated refit: NeMo-RL's sender streams ``tensors`` while the adapter receives."""
    sender = nemo_rl_sender.stream_in_thread(gen.uuid, tensors, **kwargs)
    try:
        return gen.update_weights_via_ipc_zmq()
    finally:
        sender.join(timeout=600)
        assert not sender.is_alive() and sender.error is None, sender.error
        Path(f"/tmp/{gen.uuid}.sock").unlink(missing_ok=True)


@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_nemo_rl_refit_changes_what_generate_returns_and_back(backend, tmp_path, monkeypatch):
    """NeMo-RL's colocated refit as its GRPO loop drives it (``prepare_refit_info`` once, then per
    step ``prepare_for_generation``, ``update_weights_via_ipc_zmq`` while the training rank streams
    CUDA IPC buffers over ZMQ, ``generate``, ``finish_generation``) reaches the engine: after a
    refit with another policy's weights ``generate`` returns that policy's greedy output, and after
    one with the first weights the first output again. Small buffers: the stream spans many groups,
    and the embedding goes alone in a temporary buffer. ``trtllm``: the TensorRT-LLM engine over the
    stand-in module (tests/trtllm_standin.py), built as the adapter builds it."""
    if backend == "trtllm":
        trtllm_standin.install(monkeypatch)
    first, second = tiny_target(seed=3), tiny_target(seed=9)
    folder = save_hf_folder(first, tmp_path / "t")
    tlt = TLTBlock(backend=backend, target_dir=str(folder), rollout=SpecDecodingConfig(sd_enabled=False))
    gen = _ipc_adapter(tlt, monkeypatch)
    gen.prepare_refit_info({n: (tuple(t.shape), t.dtype) for n, t in first.state_dict().items()})
    biggest = max(t.numel() * t.element_size() for t in first.state_dict().values())

    def step(policy):
        assert gen.prepare_for_generation()
        assert _refit(gen, policy.state_dict().items(), buffer_bytes=biggest) == []
        out = gen.generate(DATUM, greedy=True)
        assert gen.finish_generation()
        return {k: v.tolist() for k, v in out.items()}

    def alone(policy):
        out = TLTGeneration(TorchRolloutEngine(policy), SamplingParams(mode="rejection", max_new_tokens=8),
                            pad_token_id=0).generate(DATUM, greedy=True)
        return {k: v.tolist() for k, v in out.items()}

    def same(got, want):  # token for token; log-probs to fp32 rounding (TensorRT-LLM's from a full forward)
        torch.testing.assert_close(torch.tensor(got.pop("logprobs")), torch.tensor(want.pop("logprobs")),
                                   rtol=0, atol=1e-5)
        return got == want

    at_first, at_second, back = step(first), step(second), step(first)
    assert at_second["output_ids"] != at_first["output_ids"] and same(back, dict(at_first))
    assert same(at_first, alone(first)) and same(at_second, alone(second))
    assert gen.shutdown() and gen.shutdown()


def test_nemo_rl_refit_failures_are_named_and_the_sender_finishes(tmp_path, monkeypatch):
    """A stream that is not what prepare_refit_info said (a tensor missing, of another shape, of
    another dtype) raises, naming it, and the rest of the stream is acknowledged: the sender
    finishes instead of waiting out its timeout; the next refit works."""
    first = tiny_target(seed=3)
    tlt = TLTBlock(target_dir=str(save_hf_folder(first, tmp_path / "t")), rollout=SpecDecodingConfig(sd_enabled=False))
    gen = _ipc_adapter(tlt, monkeypatch)
    state = first.state_dict()
    gen.prepare_refit_info({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    with pytest.raises(ValueError, match="update_weights_via_ipc_zmq: prepare_refit_info"):
        TLTGeneration(gen.engine, gen.sampling, 0, device_uuid="GPU-x").update_weights_via_ipc_zmq()
    name = next(iter(state))
    with pytest.raises(ValueError, match="never arrived"):
        _refit(gen, [(n, t) for n, t in state.items() if n != name])
    info = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    gen.prepare_refit_info({**info, name: ((1,) + tuple(state[name].shape), state[name].dtype)})
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape"):
        _refit(gen, state.items())
    gen.prepare_refit_info({**info, name: (tuple(state[name].shape), torch.float16)})
    with pytest.raises(ValueError, match="the sender used"):
        _refit(gen, state.items())
    gen.prepare_refit_info({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    assert _refit(gen, state.items()) == []


def test_nemo_rl_non_colocated_refit_is_refused_at_setup():
    """Non-colocated NeMo-RL joins the generation into an NCCL group at setup (``init_collective``)
    and broadcasts into it each step; the adapter joins none, so it refuses at setup, by name,
    instead of leaving the trainer waiting."""
    gen = nemo_rl_adapter()
    with pytest.raises(ValueError, match="colocated.enabled=false"):
        gen.init_collective("127.0.0.1", 1234, 2, train_world_size=4)
    with pytest.raises(ValueError, match="colocated.enabled=false"):
        gen.update_weights_from_collective()


def test_aligner_backend_meets_gpt_generate_trtllm(tmp_path):
    folder = save_hf_folder(tiny_target(seed=3), tmp_path / "t")
    backend = TLTGenerateBackend(read_aligner_config(OmegaConf.create(aligner_yaml(folder))))
    assert interface_deviations(backend, NEMO_ALIGNER_GENERATE) == []
    out = backend.generate((torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]]), torch.tensor([3, 2])))
    sizes = {"B": 2, "S": int(out["response_lengths"].max())}
    assert output_deviations(out, NEMO_ALIGNER_GENERATE.outputs, sizes) == []


# ---- the checks catch drift --------------------------------------------------------------------------
class Drifted(TLTGeneration):
    """An adapter with one drift per method, to see each named."""

    def init_collective(self, ip, port, world_size, train_world_size):  # keyword-only lost
        return []

    def generate(self, data, greedy_decoding=False):  # argument renamed
        return {}

    shutdown = None  # abstract method missing

    def prepare_for_generation(self):  # *args / **kwargs lost
        return True

    def prepare_refit_info(self, state_dict_info, strict):  # extra required argument
        return None


def test_interface_check_names_each_drift():
    problems = interface_deviations(Drifted.__new__(Drifted), NEMO_RL_GENERATION)
    for expected in ("init_collective: parameter 'train_world_size' is POSITIONAL_OR_KEYWORD",
                     "generate: has no parameter 'greedy'", "shutdown: missing",
                     "prepare_for_generation: takes no *args", "prepare_refit_info: extra parameter 'strict'"):
        assert any(expected in p for p in problems), (expected, problems)


def test_signature_check_wants_defaults_and_positions():
    fact = Method("f", (Param("a"), Param("b", default=1), Param("c", KEYWORD_ONLY)), "None")
    assert signature_deviations(lambda a, b=1, *, c: None, fact) == []
    assert signature_deviations(lambda a, b=1, *, c, d=0: None, fact) == []
    assert any("needs the default" in p for p in signature_deviations(lambda a, b, *, c: None, fact))
    assert any("defaults to 2" in p for p in signature_deviations(lambda a, b=2, *, c: None, fact))
    assert any("not at position 0" in p for p in signature_deviations(lambda b=1, a=0, *, c=0: None, fact))


def test_output_check_names_missing_and_wrong_keys():
    out = nemo_rl_adapter().generate(DATUM, True)
    sizes = {"B": 2, "S": int(out["unpadded_sequence_lengths"].max())}
    renamed = {("log_probs" if k == "logprobs" else k): v for k, v in out.items()}
    assert output_deviations(renamed, NEMO_RL_GENERATION.outputs, sizes, DATUM) == [
        "output key 'logprobs' is missing"]
    wrong = {**out, "logprobs": out["logprobs"][:, 1:].double(), "generation_lengths": [1, 2]}
    problems = output_deviations(wrong, NEMO_RL_GENERATION.outputs, sizes, DATUM)
    assert any("'logprobs' has dtype torch.float64" in p for p in problems)
    assert any("'logprobs' has shape" in p for p in problems)
    assert any("'generation_lengths' is a list" in p for p in problems)
    no_truncated = {k: v for k, v in out.items() if k != "truncated"}  # NotRequired in NeMo-RL's spec
    assert output_deviations(no_truncated, NEMO_RL_GENERATION.outputs, sizes, DATUM) == []


FAKE_NEMO_RL = '''
import abc, importlib.machinery, sys, types
for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.generation", "nemo_rl.models.generation.interfaces"):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = module

class GenerationInterface(abc.ABC):  # NeMo-RL's abstract methods
    @abc.abstractmethod
    def init_collective(self, ip, port, world_size, *, train_world_size): ...
    @abc.abstractmethod
    def generate(self, data, greedy): ...
    @abc.abstractmethod
    def prepare_for_generation(self, *args, **kwargs): ...
    @abc.abstractmethod
    def finish_generation(self, *args, **kwargs): ...
    @abc.abstractmethod
    def shutdown(self): ...

sys.modules["nemo_rl.models.generation.interfaces"].GenerationInterface = GenerationInterface
from nemo_tlt.integrations.nemo_rl import TLTGeneration
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
sys.path.insert(0, "tests")
from tiny import tiny_target
gen = TLTGeneration(TorchRolloutEngine(tiny_target()), SamplingParams(mode="rejection"), pad_token_id=0)
assert isinstance(gen, GenerationInterface), TLTGeneration.__mro__
print("subclassed")
'''


def test_the_adapter_subclasses_nemo_rls_interface_where_it_imports():
    """With NeMo-RL importable (a module of its abstract ``GenerationInterface`` here), the adapter
    is a subclass, and instantiable: it implements every abstract method."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", FAKE_NEMO_RL], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "subclassed", proc.stderr[-2000:]


def test_the_receiver_waits_for_its_copies_before_each_acknowledgement():
    """The sender reuses a buffer once acknowledged, and a CUDA copy out of it is only queued:
    the receiver synchronises before every acknowledgement (order checked on a scripted socket),
    and an ``IPCProtocol`` member other than COMPLETE is not the end of the stream."""
    import pickle

    from nemo_tlt.integrations.nemo_rl_refit import Receiver, aligned_size, decode
    from torch.multiprocessing.reductions import reduce_tensor

    info = {"a": (torch.Size([3]), torch.float32), "b": (torch.Size([2]), torch.float32)}
    groups = []
    for name, values in (("a", [1.0, 2.0, 3.0]), ("b", [4.0, 5.0])):
        buf = torch.zeros(aligned_size(12), dtype=torch.uint8)
        raw = torch.tensor(values).view(torch.uint8)
        buf[:raw.numel()] = raw
        groups.append(pickle.dumps((reduce_tensor(buf)[1:], [name], aligned_size(raw.numel()))))
    inbox = groups + [nemo_rl_sender.complete_message()]
    events = []
    receiver = Receiver(lambda: (events.append("recv"), inbox.pop(0))[1], lambda b: events.append(b.decode()),
                        info, nemo_rl_sender.rebuild_cpu, synchronize=lambda buf: events.append("sync"))
    got = dict(receiver)
    assert got["a"].tolist() == [1.0, 2.0, 3.0] and got["b"].tolist() == [4.0, 5.0]
    assert events == ["recv", "sync", "ack", "recv", "sync", "ack", "recv", "ack"]
    assert decode(nemo_rl_sender.complete_message()) is None
    with pytest.raises(ValueError, match="expected"):  # not COMPLETE: a malformed message, not the end
        decode(nemo_rl_sender.complete_message(nemo_rl_sender.IPCProtocol.ACK))
