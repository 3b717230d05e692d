"""`jobs.gateway.completions`'s pure pieces: text offsets of echoed tokens, on the tiny
Gemma 3's real published tokenizer (its small vocabulary spells most characters in
byte-fallback tokens) and the real Gemma 3's."""

from __future__ import annotations

import pytest

from jobs.gateway.completions import text_offsets
from jobs.tokenizer import ServedTokenizer, pack_tokenizer

TEXTS = ["The capital of France is Paris.", "a 𓀀𓀁 b ", "Héllo ✓ 日本 🤗\n\n  x",
         "€" * 300, ""]


def served(loaded) -> ServedTokenizer:
    return ServedTokenizer.from_blob(pack_tokenizer(loaded.tokenizer.published()))


def check_offsets(tokenizer: ServedTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = [tokenizer.piece(i) for i in ids]
    offsets = text_offsets(ids, pieces, tokenizer)
    decoded = tokenizer.decode(ids)
    assert len(offsets) == len(ids) and offsets == sorted(offsets)
    assert all(0 <= o <= len(decoded) for o in offsets)
    for i, offset in enumerate(offsets):
        rest = tokenizer.decode(ids[i:])
        if not rest.startswith("\ufffd"):  # token i starts a character
            assert decoded[offset:] == rest, (text, i)
        else:  # inside a character: at that character's offset
            assert decoded[offset:].endswith(rest.lstrip("\ufffd"))
            assert decoded[offset] != "\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_offsets_index_the_decoded_text_on_the_tiny_tokenizer(tiny, text):
    check_offsets(served(tiny), text)


def test_a_four_byte_character_in_byte_tokens_has_one_offset(tiny):
    tokenizer = served(tiny)
    ids = tokenizer.encode("a 𓀀𓀁 b ", add_bos=False)
    pieces = [tokenizer.piece(i) for i in ids]
    offsets = text_offsets(ids, pieces, tokenizer)
    text = tokenizer.decode(ids)
    assert text == "a 𓀀𓀁 b "
    starts = dict(zip(offsets, pieces, strict=True))  # the first token at each offset
    assert sorted(starts) == sorted(set(offsets))
    assert text.index(" b") in offsets and text.index("𓀁") in offsets


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_offsets_index_the_decoded_text_on_gemma3(gemma, text):
    check_offsets(served(gemma), text)
