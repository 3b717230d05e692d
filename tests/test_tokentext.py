"""`tokentext.TokenText`, the decoder both tokenizers use: every id's text (control tokens
included unless skipped), and each token's share of a sequence's text when characters are
spelled in several byte tokens. On a table of single bytes and short strings (any byte
sequence, invalid UTF-8 included) and on the tiny Gemma 3's real SentencePiece vocabulary."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest

from tokentext import TokenText

# ids 0-255: one byte each; then whole characters and a control token
WORDS = [b" the", "é".encode(), "🤖".encode(), b"<bos>", b"", b"\n"]
SPECIAL = {256 + WORDS.index(b"<bos>")}


@pytest.fixture(scope="module")
def table() -> TokenText:
    return TokenText([bytes([b]) for b in range(256)] + WORDS, SPECIAL)


def assert_pieces_spell(text: TokenText, ids: list[int]) -> None:
    """The pieces join to the decoded text, and each is found at its offset in it."""
    pieces = text.pieces(ids)
    decoded = text.decode(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == decoded
    for piece, offset in zip(pieces, accumulate(map(len, pieces), initial=0), strict=False):
        assert decoded[offset:offset + len(piece)] == piece


def test_a_character_in_byte_tokens_is_the_piece_of_the_one_that_completes_it(table):
    ids = [ord("a"), *"🤖".encode(), 256 + 1, ord("b")]  # a, 4 bytes, é, b
    assert table.pieces(ids) == ["a", "", "", "", "🤖", "é", "b"]
    assert table.decode(ids) == "a🤖éb"
    assert [table.piece(i) for i in ids[1:5]] == ["\ufffd"] * 4  # alone, a byte is no character


def test_bytes_unfinished_or_invalid_give_replacement_characters(table):
    truncated = [*"🤖".encode()[:3], ord("x")]  # "x" ends the character unfinished
    assert table.pieces(truncated) == ["", "", "", "\ufffdx"]
    assert table.pieces([*"é".encode()[:1]]) == ["\ufffd"]  # flushed at the end
    assert table.pieces([0xFF, 0x80, ord("y")]) == ["\ufffd", "\ufffd", "y"]
    assert table.pieces([]) == [] and table.decode([]) == ""


def test_random_byte_sequences_spell_their_decoded_text(table):
    rng = np.random.default_rng(0)
    utf8_heads = list(range(0x80, 0x100))
    for _ in range(2000):
        pool = utf8_heads if rng.random() < 0.5 else range(256 + len(WORDS))
        ids = [int(rng.choice(pool)) for _ in range(rng.integers(0, 12))]
        assert_pieces_spell(table, ids)
        assert table.decode(ids) == b"".join(table._bytes[i] for i in ids).decode(
            "utf-8", errors="replace")


def test_special_ids_give_their_text_unless_skipped(table):
    bos = next(iter(SPECIAL))
    ids = [bos, *b"hi", 256]
    assert table.decode(ids) == "<bos>hi the"
    assert table.decode(ids, skip_special_tokens=True) == "hi the"
    assert table.piece(bos) == "<bos>"


def test_of_a_sentencepiece_vocabulary_reads_its_decoder_and_byte_tokens(tiny):
    hf = tiny.tokenizer._hf
    text = TokenText.of(hf, tiny.vocab_size)
    bos = tiny.tokenizer.bos_id
    assert text.piece(bos) == "<bos>" and text.decode([bos], skip_special_tokens=True) == ""
    assert text._bytes[hf.token_to_id("<0xE4>")] == b"\xe4"
    for sample in ["Héllo ✓ 日本 🤗\n\n  x", "a 𓀀𓀁 b ", "<bos>x", ""]:
        ids = hf.encode(sample).ids
        assert text.decode(ids) == hf.decode(ids, skip_special_tokens=False) == "<bos>" + sample
        assert text.decode(ids, skip_special_tokens=True) == hf.decode(ids).replace("<bos>", "")
        assert_pieces_spell(text, ids)
