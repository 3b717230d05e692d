"""Token ids -> text: the one decoder the worker's tokenizer (`model.tokenizer`) and the
client's (`jobs.tokenizer`) share, so both give the same text. Needs only `tokenizers`.

Each id has bytes, llama.cpp's ``token_to_piece(id, special=True)`` (``src/llama-vocab.cpp``):
control tokens give their text (``<bos>``, ``<start_of_turn>``), byte-fallback tokens their
one byte, other tokens their text with the vocabulary's spelling undone. A sequence's text is
its ids' bytes joined and read as UTF-8 (an invalid byte sequence gives U+FFFD), as
llama.cpp's ``detokenize(special=True)`` and transformers' ``decode(skip_special_tokens=False)``
give it; ``skip_special_tokens=True`` leaves control tokens out.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

__all__ = ["TokenText"]

# SentencePiece's spelling of a byte-fallback token, as `tokenizers`' BPE writes it.
_BYTE_TOKEN = "<0x{:02X}>"


class TokenText:
    """Every token id's bytes, and which ids are special: `decode`, `piece` and `pieces`.

    Ids are not checked here: callers check them against the vocabulary first (an id
    outside ``0 .. vocab_size - 1`` raises IndexError or, if negative, reads from the end).
    """

    def __init__(self, id_bytes: Sequence[bytes], special: Collection[int]) -> None:
        """Args:
            id_bytes: each id's bytes, special ids' text included (``vocab_size`` entries).
            special: the ids `decode` leaves out with ``skip_special_tokens=True``.
        """
        self._bytes = list(id_bytes)
        self._special = frozenset(special)

    @classmethod
    def of(cls, hf: HFTokenizer, vocab_size: int,
           piece_bytes: Sequence[bytes] | None = None) -> TokenText:
        """The text of a `tokenizers` object's ids; ~0.4 s for Gemma 3's 262,144.

        Args:
            hf: the tokenizer; its special added tokens are the special ids, and their
                content is their text.
            vocab_size: number of ids.
            piece_bytes: each id's bytes with special ids as ``b""`` (byte-level BPE, whose
                `tokenizers` decoder cannot give a lone byte); None: `hf`'s decoder's text of
                each id alone, and a byte-fallback token's (``<0xE4>``) byte.
        """
        special = {i: t.content for i, t in hf.get_added_tokens_decoder().items()
                   if t.special and i < vocab_size}
        base = list(piece_bytes) if piece_bytes is not None else _decoded(hf, vocab_size)
        for i, content in special.items():
            base[i] = content.encode("utf-8")
        return cls(base, special)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` (`ids` valid: see the class).

        Args:
            ids: token ids.
            skip_special_tokens: leave control tokens out (llama.cpp's ``special=False``).
        """
        table, special = self._bytes, self._special
        if skip_special_tokens:
            ids = [i for i in ids if i not in special]
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """One id's text alone: ``decode([token_id])`` (a lone byte of a multi-byte
        character gives U+FFFD)."""
        return self._bytes[token_id].decode("utf-8", errors="replace")

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's share of ``decode(ids)``: the characters it completes, read as a stream.

        A character spelled in several byte tokens belongs to the token that completes it;
        the tokens before give ``""``. So ``"".join(pieces(ids)) == decode(ids)``, and a
        token's character offset is the length of the pieces before it. Bytes that cannot
        finish a character give U+FFFD on the token that shows it (the next one, or the
        last).
        """
        table = self._bytes
        reader = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [reader.decode(table[i]) for i in ids]
        if out:
            out[-1] += reader.decode(b"", final=True)
        return out


def _decoded(hf: HFTokenizer, vocab_size: int) -> list[bytes]:
    texts = hf.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    out = [t.encode("utf-8") for t in texts]
    for byte in range(256):
        i = hf.token_to_id(_BYTE_TOKEN.format(byte))
        if i is not None and i < vocab_size:
            out[i] = bytes([byte])
    return out
