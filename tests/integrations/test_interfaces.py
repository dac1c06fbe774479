"""The adapters held to the real interfaces as recorded in
``nemo_tlt.integrations.interface_facts`` (NeMo-RL's GenerationInterface and its output
spec, NeMo-Aligner's GPTGenerateTRTLLM as its actors call it): every abstract or called
method present with a signature that accepts the real calls, every output key present with
the real dtype and shape. The second half checks that the checks catch drift."""
from __future__ import annotations

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
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
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


def test_nemo_rl_init_collective_takes_train_world_size_by_keyword_and_shutdown_repeats():
    gen = nemo_rl_adapter()
    assert gen.init_collective("127.0.0.1", 1234, 2, train_world_size=4) == []
    with pytest.raises(TypeError):
        gen.init_collective("127.0.0.1", 1234, 2, 4)
    assert gen.shutdown() and gen.shutdown()


def test_nemo_rl_stop_strings_are_refused_by_name():
    with pytest.raises(ValueError, match="stop_strings"):
        nemo_rl_adapter().generate({**DATUM, "stop_strings": [["\n"], None]}, True)
    nemo_rl_adapter().generate({**DATUM, "stop_strings": [None, None]}, True)


def test_nemo_rl_adapter_selects_the_engine_from_the_tlt_block(tmp_path):
    folder = save_hf_folder(tiny_target(seed=3), tmp_path / "t")
    gen = TLTGeneration.from_tlt_block(TLTBlock(target_dir=str(folder)), SamplingParams(mode="rejection"), 0)
    assert isinstance(gen.engine, TorchRolloutEngine)
    trt = TLTBlock(backend="trtllm", target_dir=str(folder))
    with pytest.raises(ImportError, match=r"pip install nemo-tlt\[trtllm\]"):
        TLTGeneration.from_tlt_block(trt, SamplingParams(mode="rejection"), 0)


@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_nemo_rl_refit_changes_what_generate_returns_and_back(backend, tmp_path, monkeypatch):
    """NeMo-RL's refit protocol as its GRPO loop drives it (``prepare_refit_info`` once, then per
    step ``prepare_for_generation``, ``update_weights_from_collective``, ``generate``,
    ``finish_generation``) reaches the engine: after a refit with another policy's weights
    ``generate`` returns that policy's greedy output, and after one with the first weights the
    first output again. ``trtllm``: the TensorRT-LLM engine over the stand-in module
    (tests/trtllm_standin.py), built with ``load_format='dummy'`` as the adapter builds it."""
    if backend == "trtllm":
        trtllm_standin.install(monkeypatch)
    first, second = tiny_target(seed=3), tiny_target(seed=9)
    folder = save_hf_folder(first, tmp_path / "t")
    sent: dict[str, dict[str, torch.Tensor]] = {}  # what the trainer's collective broadcast carries
    tlt = TLTBlock(backend=backend, target_dir=str(folder), rollout=SpecDecodingConfig(sd_enabled=False))
    gen = TLTGeneration.from_tlt_block(tlt, SamplingParams(mode="rejection", max_new_tokens=8), pad_token_id=0,
                                       weight_source=lambda: iter(sent["weights"].items()))
    gen.prepare_refit_info({n: (tuple(t.shape), t.dtype) for n, t in first.state_dict().items()})

    def step(policy):
        sent["weights"] = policy.state_dict()
        assert gen.prepare_for_generation() and gen.update_weights_from_collective() == []
        out = gen.generate(DATUM, greedy=True)
        assert gen.finish_generation()
        return {k: v.tolist() for k, v in out.items()}

    def alone(policy):
        out = TLTGeneration(TorchRolloutEngine(policy), SamplingParams(mode="rejection", max_new_tokens=8),
                            pad_token_id=0).generate(DATUM, greedy=True)
        return {k: v.tolist() for k, v in out.items()}

    at_first, at_second, back = step(first), step(second), step(first)
    assert at_first == alone(first) and at_second == alone(second)
    assert at_second["output_ids"] != at_first["output_ids"] and back == at_first


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
