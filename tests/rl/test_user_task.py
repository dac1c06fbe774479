"""A user's own task: GRPO + TLT on a JSONL of prompts, a reward function named by
import path, and the HF tokenizer saved in the model folder (no demo code involved)."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.io import save_drafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.train import main

pytestmark = pytest.mark.timeout(180)

PROMPTS = [("2+3=", "5"), ("4+4=", "8"), ("1+6=", "7"), ("9-2=", "7"), ("3+3=", "6"), ("8-5=", "3")]
HERE = __name__  # this module's import name under pytest, for the reward's import path
SEEN: list[tuple[str, str | None, float]] = []  # (prompt text, answer, bonus) of every reward call


def exact_match(prompt, response: str, bonus: float = 0.0) -> float:
    """The user's reward: 1 for the reference answer, ``bonus`` for anything else."""
    SEEN.append((prompt.text, prompt.answer, bonus))
    return 1.0 if response.strip() == prompt.answer else bonus


def _hf_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    chars = list("0123456789+-= ")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>")
    return fast


def test_grpo_tlt_on_a_user_jsonl_task_with_an_imported_reward(tmp_path):
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    tok = _hf_tokenizer()
    torch.manual_seed(0)
    lm = LMConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf_folder(DecoderLM(lm), target_dir)
    tok.save_pretrained(target_dir)  # beside config.json, as transformers lays out a model folder
    save_drafter(EagleDrafter(EagleConfig.from_target(lm)), drafter_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROMPTS))
    config = tmp_path / "user.yaml"
    config.write_text(f"""
run_dir: {tmp_path / 'run'}
steps: 2
progress: false
task:
  source: jsonl
  options: {{path: {data}, prompt_key: question}}
  reward: {HERE}:exact_match
  reward_options: {{bonus: 0.25}}
  tokenizer: hf
model: {{target_dir: {target_dir}, drafter_dir: {drafter_dir}}}
grpo: {{group_size: 2, prompts_per_step: 3, max_new_tokens: 6, acceptance: coupled}}
workers: {{num_workers: 1}}
""")
    SEEN.clear()
    assert main([str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "tlt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    # every reward call saw one of the user's prompts with its own answer, and the options
    assert len(SEEN) == 2 * 3 * 2
    assert {(text, answer) for text, answer, _ in SEEN} <= set(PROMPTS)
    assert {bonus for _, _, bonus in SEEN} == {0.25}
    assert all(r in (0.25, 1.0) for rec in records for r in rec["rewards"])
