"""Helpers the conformance tests share (drafters, requests); fixtures are in conftest.py,
the engines and their declared limits in engines.py."""
from __future__ import annotations

import torch

from nemo_tlt.rollout.protocol import SUITE_DRAFTERS
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.medusa import MedusaConfig, MedusaDrafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.rollout.protocol import GenerateOutput, Request
from tiny import OracleDrafter

DRAFTERS = SUITE_DRAFTERS  # the kinds an engine declares (nemo_tlt.rollout.protocol.EngineLimits)


def make_drafter(kind: str, cfg: LMConfig):
    """A drafter of each kind the suite drafts with, for a target of config `cfg`:
    fresh EAGLE, EAGLE-3 (reduced draft vocabulary: 3/4 of the ids, so some target
    tokens cannot be drafted at all) and Medusa (accept now and then), the target itself ("oracle",
    accepts almost always) and its reverse ("adversarial", almost never). The oracle
    kinds are torch modules that run the engine's own target (tests/tiny.py)."""
    if kind == "eagle":
        return EagleDrafter(EagleConfig.from_target(cfg), generator=torch.Generator().manual_seed(1))
    if kind == "eagle3":
        draft_vocab = 3 * cfg.vocab_size // 4
        drafter = Eagle3Drafter(Eagle3Config.from_target(cfg, draft_vocab_size=draft_vocab),
                                generator=torch.Generator().manual_seed(1))
        drafter.set_draft_vocab(torch.arange(cfg.vocab_size - draft_vocab, cfg.vocab_size))
        return drafter
    if kind == "medusa":
        return MedusaDrafter(MedusaConfig(cfg.hidden_size, cfg.vocab_size, 4))
    if kind in ("oracle", "adversarial"):
        return OracleDrafter(adversarial=kind == "adversarial")
    raise ValueError(f"unknown drafter kind {kind!r}")


def requests(lengths, seed: int = 0, vocab: int = 32) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(3, vocab, (n,), generator=g).tolist(), seq_id=100 + i)
            for i, n in enumerate(lengths)]


def tokens(out: GenerateOutput) -> list[list[int]]:
    return [r.tokens for r in out.results]
