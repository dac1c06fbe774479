"""The NeMo-Aligner backend and the NeMo-RL adapter, with the embedded torch engine behind
them (NeMo-Aligner, NeMo-RL and TensorRT-LLM are not importable here)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nemo_tlt.integrations.nemo_aligner import TLTGenerateBackend, read_aligner_config
from nemo_tlt.integrations.nemo_rl import TLTGeneration
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from tiny import tiny_target

CONF = Path(__file__).resolve().parents[2] / "conf" / "nemo_aligner_ppo_tlt.yaml"


def aligner_yaml(target_dir, backend="torch", greedy=True) -> str:
    return f"""
trainer:
  ppo:
    trt_llm:
      enable: true
      reshard: false
      max_input_len: ${{subtract:${{model.encoder_seq_length}}, ${{model.ppo.length_params.max_length}}}}
      seed: ${{model.seed}}
      model_type: llama
      unload_engine_train: false
    trt_model_dir: /tmp/x
model:
  encoder_seq_length: 64
  seed: 7
  ppo:
    sampling_params: {{use_greedy: {str(greedy).lower()}, temperature: 1.0, top_k: 0, top_p: 1.0}}
    length_params: {{max_length: 12}}
tlt:
  backend: {backend}
  target_dir: {target_dir}
  rollout: {{sd_enabled: false}}
"""


def test_example_conf_selects_trtllm_with_the_tlt_block():
    cfg = read_aligner_config(OmegaConf.load(CONF))
    assert cfg.enable and cfg.tlt.backend == "trtllm" and cfg.max_input_len == 4096 - 2048
    assert cfg.tlt.trtllm.max_draft_len == 4 and cfg.tlt.rollout.threshold.threshold_on == 32
    assert cfg.tlt.drafter.harvest_from == "policy"


def test_reader_names_missing_and_bad_keys(tmp_path):
    bad = OmegaConf.create(aligner_yaml(tmp_path))
    del bad.trainer.ppo.trt_llm["seed"]
    with pytest.raises(ValueError, match="trainer.ppo.trt_llm.seed' is missing"):
        read_aligner_config(bad)
    wrong = OmegaConf.create(aligner_yaml(tmp_path, backend="vllm"))
    with pytest.raises(ValueError, match="backend must be one of"):
        read_aligner_config(wrong)


def test_aligner_backend_refit_generate_free_shapes(tmp_path):
    folder = save_hf_folder(tiny_target(seed=3), tmp_path / "t")
    cfg = read_aligner_config(OmegaConf.create(aligner_yaml(folder)))
    backend = TLTGenerateBackend(cfg)
    other = tiny_target(seed=5)
    backend.refit(other)
    prompts = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]])
    out = backend.generate((prompts, torch.tensor([3, 2])))
    ref = TorchRolloutEngine(other)
    from nemo_tlt.rollout.protocol import Request
    want = ref.generate([Request([3, 4, 5]), Request([6, 7])], SamplingParams(max_new_tokens=12)).results
    lengths = out["response_lengths"].tolist()
    assert lengths == [3 + len(want[0].tokens), 2 + len(want[1].tokens)]
    assert out["response_tokens"].shape == (2, max(lengths))
    assert out["response_tokens"][0, :lengths[0]].tolist() == [3, 4, 5] + want[0].tokens
    assert out["response_tokens"][1, :lengths[1]].tolist() == [6, 7] + want[1].tokens
    backend.free()


def test_nemo_rl_adapter_keys_padding_and_refit(tmp_path):
    target = tiny_target(seed=3)
    engine = TorchRolloutEngine(target)
    new = tiny_target(seed=9).state_dict()
    gen = TLTGeneration(engine, SamplingParams(mode="rejection", max_new_tokens=6), pad_token_id=0)
    gen.update_weights(new)
    assert gen.prepare_for_generation()
    out = gen.generate({"input_ids": torch.tensor([[3, 4, 0], [5, 6, 7]]), "input_lengths": torch.tensor([2, 3])},
                       greedy=True)
    ref = TorchRolloutEngine(tiny_target(seed=9))
    from nemo_tlt.rollout.protocol import Request
    want = ref.generate([Request([3, 4]), Request([5, 6, 7])], SamplingParams(max_new_tokens=6)).results
    assert out["generation_lengths"].tolist() == [len(w.tokens) for w in want]
    assert out["unpadded_sequence_lengths"].tolist() == [2 + len(want[0].tokens), 3 + len(want[1].tokens)]
    n0 = int(out["unpadded_sequence_lengths"][0])
    assert out["output_ids"][0, :n0].tolist() == [3, 4] + want[0].tokens
    assert (out["output_ids"][0, n0:] == 0).all()
    assert out["truncated"].tolist() == [w.stop_reason == "length" for w in want]
    # the engine's log-probs in NeMo-RL's layout: at the generated tokens' positions, zeros elsewhere
    for b, (P, w) in enumerate(zip([2, 3], want)):
        n = P + len(w.tokens)
        assert out["logprobs"][b, P:n].tolist() == w.logprobs and len(w.logprobs) == len(w.tokens)
        assert not out["logprobs"][b, :P].any() and not out["logprobs"][b, n:].any()
    assert gen.finish_generation()
