"""The data of a first drafter: the user's prompts, the target's tokenizer, and the
target's own responses with the features the drafter learns from.

Contract
--------
* `read_prompts(path, prompt_key)`: the prompt texts of a JSONL file (one object per
  line, ``prompt_key`` a non-empty string) or a local ``datasets`` file (.json,
  .parquet), read by the RL task sources (nemo_tlt.rl.data.task), so a file that trains
  a policy trains its drafter; errors name the file, the line and the key.
* `pick_tokenizer(target_dir, spec, ...)`: ``auto`` is the HF tokenizer saved in the
  target folder when there is one, else the demo's character tokenizer when the
  folder is a demo warm start (it holds ``warm_start.json``); ``hf`` or an import path
  ``package.module:factory`` choose, as ``task.tokenizer`` does in an RL config.
* `generate_samples`: plain (no speculation) batched decoding by the embedded engine,
  ``responses`` per prompt; response r of prompt i is sequence ``r * n + i`` so
  coupled samples differ per response and do not depend on the batching. The
  engine's ``return_hidden`` hands over the features of the same forward: the final
  hidden states, or for an EAGLE-3 drafter its captured layers and the final state
  (nemo_tlt.drafter.features); no extra target forward.
* `save_samples` / `load_samples`: one safetensors file (tokens, features and the
  sample lengths), written to a temp file and renamed, so a resumed run never
  reads half a file and never regenerates what it has.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from nemo_tlt.config import TASK_DATASETS, TASK_HF, TASK_JSONL, TaskConfig
from nemo_tlt.drafter.data import DrafterSample
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rl.data.task import TOKENIZER_FILES, Tokenizer, _build_tokenizer, build_source, check_eos, check_vocab
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams

AUTO = "auto"
DEMO_TOKENIZER = "nemo_tlt.demo.tokenizer:CharTokenizer"
DEMO_MARKER = "warm_start.json"  # written beside every demo SFT warm start (nemo_tlt.demo.sft)


def read_prompts(path: str | os.PathLike, prompt_key: str = "prompt") -> list[str]:
    """The prompt texts of ``path`` (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts: {path} is not a file")
    source = TASK_JSONL if path.suffix.lower() == ".jsonl" else TASK_DATASETS
    rows = build_source(source, {"path": str(path), "prompt_key": prompt_key}).rows
    return [row.text for row in rows]


def pick_tokenizer(target_dir: str | os.PathLike, spec: str = AUTO, chat_template: bool = False,
                   system_prompt: str | None = None) -> Tokenizer:
    """The tokenizer of the target in ``target_dir`` (see the module docstring)."""
    folder = Path(target_dir)
    if spec == AUTO:
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            spec = TASK_HF
        elif (folder / DEMO_MARKER).is_file():
            spec = DEMO_TOKENIZER
        else:
            raise ValueError(f"--tokenizer auto: {folder} holds no tokenizer (none of {list(TOKENIZER_FILES)}) and is "
                             "not a demo target; save the model's tokenizer there or pass --tokenizer "
                             "package.module:factory")
    try:
        cfg = TaskConfig(tokenizer=spec, chat_template=chat_template, system_prompt=system_prompt)
    except ValueError as err:
        raise ValueError(f"--tokenizer / --chat-template: {err}") from None
    return _build_tokenizer(cfg, str(folder))


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], target: DecoderLM, target_dir: str) -> list[list[int]]:
    """Token ids (BOS + prompt, as the RL loop encodes them), checked against the target."""
    check_vocab(tokenizer, target.config.vocab_size, target_dir)
    check_eos(tokenizer, target.config.eos_token_id, target_dir)
    return [tokenizer.encode(text, add_bos=True) for text in prompts]


def generate_samples(target: DecoderLM, drafter: torch.nn.Module, prompts: list[list[int]],
                     sampling: SamplingParams, responses: int, batch_size: int,
                     progress: bool = True) -> list[DrafterSample]:
    """``responses`` responses of the target to each prompt, with the features ``drafter`` reads."""
    n = len(prompts)
    requests = [Request(prompts[i], seq_id=r * n + i) for r in range(responses) for i in range(n)]
    engine = TorchRolloutEngine(target, drafter)
    samples: list[DrafterSample] = []
    with tqdm(total=len(requests), desc="generate", unit="response", disable=not progress) as bar:
        for start in range(0, len(requests), batch_size):
            chunk = requests[start: start + batch_size]
            results = engine.generate(chunk, sampling, return_hidden=True).results
            samples += [DrafterSample(torch.tensor(list(q.prompt) + r.tokens), r.hidden_states)
                        for q, r in zip(chunk, results)]
            bar.update(len(chunk))
    return samples


def save_samples(samples: list[DrafterSample], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"tokens": torch.cat([s.tokens for s in samples]),
               "features": torch.cat([s.hidden for s in samples]).contiguous(),
               "lengths": torch.tensor([s.tokens.shape[0] for s in samples])}
    tmp = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def load_samples(path: str | os.PathLike) -> list[DrafterSample]:
    t = load_file(str(path))
    lengths = t["lengths"].tolist()
    tokens = t["tokens"].split(lengths)
    features = t["features"].split([m - 1 for m in lengths])
    return [DrafterSample(x, f) for x, f in zip(tokens, features)]
