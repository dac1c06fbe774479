"""CharTokenizer: fixed ids, round trip, special tokens, clear errors."""
import numpy as np
import pytest

from nemo_tlt.demo.tasks import TASK_NAMES, TaskConfig, make_problems, sft_text
from nemo_tlt.demo.tokenizer import ALPHABET, BOS_ID, EOS_ID, PAD_ID, CharTokenizer


def test_special_ids_and_small_vocab():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.vocab_size == 3 + len(ALPHABET) <= 64
    # Ids are a fixed function of the alphabet: '0' is the first character.
    assert tok.encode("0") == [3]
    assert sorted(set(tok.encode(ALPHABET))) == list(range(3, tok.vocab_size))


def test_round_trip_and_bos():
    tok = CharTokenizer()
    text = "3+5=8;8-2=6#6\nsort:3,1=a b"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == BOS_ID and len(ids) == len(text) + 1
    assert tok.decode(ids) == text


def test_decode_skips_specials_without_stopping():
    tok = CharTokenizer()
    ids = [BOS_ID] + tok.encode("12") + [EOS_ID] + tok.encode("3") + [PAD_ID, PAD_ID]
    assert tok.decode(ids) == "123"


def test_unknown_character_is_named():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'%'"):
        tok.encode("1+2%3")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_alphabet_covers_every_task():
    tok = CharTokenizer()
    rng = np.random.default_rng(0)
    for name in TASK_NAMES:
        for problem in make_problems(TaskConfig(name=name), 200, rng):
            assert tok.decode(tok.encode(sft_text(problem))) == sft_text(problem)
