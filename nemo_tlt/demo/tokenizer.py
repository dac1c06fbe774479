"""`CharTokenizer`: a fixed character-level vocabulary for the synthetic tasks.

Contract:
- ids 0, 1, 2 are PAD, BOS, EOS; every other id is exactly one character of
  :data:`ALPHABET`, in that order, so the vocabulary never changes between runs
  (a saved model and a later tokenizer always agree).
- ``encode`` maps every character to one id and raises ``ValueError`` naming the
  first character it does not know; it never adds EOS (the trainer and the rollout
  engine decide where a sequence ends).
- ``decode`` is total over valid ids: PAD and BOS are skipped, EOS renders as
  nothing, and it does not stop at EOS (callers that want "up to EOS" cut first).

The vocabulary is kept under 64 ids so that tiny CPU models spend little on the
embedding and the LM head.
"""
from __future__ import annotations

from typing import Iterable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Everything the tasks in nemo_tlt.demo.tasks print, plus room for simple prompts.
ALPHABET = "0123456789+-*=;:#,|<>()[]. \nabcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Character tokenizer over :data:`ALPHABET` with PAD=0, BOS=1, EOS=2."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer.alphabet has repeated characters: {alphabet!r}")
        if not alphabet:
            raise ValueError("CharTokenizer.alphabet must not be empty")
        self.alphabet = alphabet
        self._char_to_id = {ch: NUM_SPECIAL + i for i, ch in enumerate(alphabet)}
        self._id_to_char = {i: ch for ch, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.alphabet)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [BOS_ID] if add_bos else []
        for pos, ch in enumerate(text):
            token = self._char_to_id.get(ch)
            if token is None:
                raise ValueError(
                    f"CharTokenizer.encode: unknown character {ch!r} at position {pos} of {text[:40]!r}; "
                    f"known characters: {self.alphabet!r}"
                )
            ids.append(token)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        chars = []
        for token in ids:
            token = int(token)
            if token in (PAD_ID, BOS_ID, EOS_ID):
                continue
            ch = self._id_to_char.get(token)
            if ch is None:
                raise ValueError(f"CharTokenizer.decode: id {token} is outside the vocabulary [0, {self.vocab_size})")
            chars.append(ch)
        return "".join(chars)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
