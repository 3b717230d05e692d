"""The tokenizer the worker's (`model.tokenizer.Tokenizer`) and the client's
(`jobs.tokenizer.ServedTokenizer`) share: one `tokenizers` object encoding as llama.cpp's
``tokenize`` and `TokenText` decoding, so a client gets exactly the worker's ids and text.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from . import TokenText

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

__all__ = ["TokenizerBase"]


class TokenizerBase:
    """`encode`, `decode`, `piece` and `pieces` over a `tokenizers` object, and its ids.

    Thread-safe: `encode` calls are serialized, since special-token parsing is a setting of
    the underlying `tokenizers` object rather than an argument of its ``encode``. A subclass
    names the errors its side raises for bad ids (`OUT_OF_RANGE_ERROR`, `NOT_INTEGER_ERROR`).
    """

    # raised for an id outside ``0 .. vocab_size - 1``, and for an id that is not an integer
    OUT_OF_RANGE_ERROR: ClassVar[type[Exception]] = IndexError
    NOT_INTEGER_ERROR: ClassVar[type[Exception]] = TypeError

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        vocab_size: int,
        add_bos: bool,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        piece_bytes: Sequence[bytes] | None,
    ) -> None:
        """Args:
            hf: the `tokenizers` object that encodes.
            vocab_size: number of ids.
            add_bos: whether `encode` prepends BOS by default (``tokenizer.ggml.add_bos_token``).
            bos_id, eos_id, pad_id: those tokens' ids, None where the vocabulary has none.
            piece_bytes: each non-special id's bytes (byte-level vocabularies), or None to ask
                `hf`'s decoder (`TokenText.of`).
        """
        self._hf = hf
        self._vocab_size = vocab_size
        self._add_bos = add_bos
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._pad_id = pad_id
        self._text = TokenText.of(hf, vocab_size, piece_bytes)
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """Number of token ids (ids are ``0 .. vocab_size - 1``)."""
        return self._vocab_size

    @property
    def add_bos(self) -> bool:
        """Whether `encode` prepends BOS by default (``tokenizer.ggml.add_bos_token``)."""
        return self._add_bos

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id, or None when the vocabulary names none."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id, or None when the vocabulary names none."""
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        """Padding token id (``tokenizer.ggml.padding_token_id``), or None."""
        return self._pad_id

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Tokenizes `text` like llama.cpp's ``tokenize(text, add_bos, special=parse_special)``.

        Args:
            text: the text, taken verbatim (no space is prepended).
            add_bos: prepend the BOS id; None follows `add_bos`. Ignored when the vocabulary
                has no BOS token.
            parse_special: match control tokens (``<start_of_turn>``, ``<bos>``, ...) written
                in `text`. When False they are tokenized as plain text. User-defined tokens
                (newline and space runs, HTML tags) are matched either way, as in llama.cpp.

        Returns:
            The token ids.
        """
        with_bos = self._add_bos if add_bos is None else add_bos
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            try:
                return self._hf.encode(text, add_special_tokens=with_bos).ids
            finally:
                self._hf.encode_special_tokens = False

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of a token id sequence, as llama.cpp's ``detokenize(ids, special=True)``
        (`TokenText.decode`).

        Control tokens (BOS, EOS, ``<start_of_turn>``, ...) give their text; byte tokens are
        joined into UTF-8 characters (an invalid byte sequence becomes U+FFFD). For ``"gpt2"``
        vocabularies every normal token is mapped back from GPT-2's byte alphabet; spaces are
        kept as they are (no clean-up of spaces before punctuation).

        Args:
            ids: token ids (ints, numpy integers included).
            skip_special_tokens: leave control tokens out (llama.cpp's ``special=False``).

        Returns:
            The text. ``decode(encode(t, add_bos=False))`` gives `t` back, except that for
            ``"llama"`` vocabularies a literal ``"▁"`` comes back as a space, and the space
            llama.cpp prepends to each text fragment when ``tokenizer.ggml.add_space_prefix``
            is on (Llama 2, Mistral; not Gemma 3) stays in the text.

        Raises:
            OUT_OF_RANGE_ERROR: an id is outside ``0 .. vocab_size - 1``.
            NOT_INTEGER_ERROR: an id is not an integer.
        """
        return self._text.decode(self._checked(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """Text of one token alone (``" Paris"``, ``"\\n\\n"``, ``"<end_of_turn>"``):
        llama.cpp's ``token_to_piece(id, special=True)``; a lone byte token that is not a
        whole UTF-8 character gives U+FFFD.

        Raises:
            OUT_OF_RANGE_ERROR, NOT_INTEGER_ERROR: as `decode`.
        """
        return self.decode([token_id])

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token's share of ``decode(ids)``, which they join to (`TokenText.pieces`): a
        character spelled in several byte tokens is the piece of the one that completes it.

        Raises:
            OUT_OF_RANGE_ERROR, NOT_INTEGER_ERROR: as `decode`.
        """
        return self._text.pieces(self._checked(ids))

    def _checked(self, ids: Sequence[int]) -> list[int]:
        try:
            ids = [operator.index(i) for i in ids]
        except TypeError as e:
            raise self.NOT_INTEGER_ERROR(f"token ids must be integers: {e}") from e
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise self.OUT_OF_RANGE_ERROR(
                f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return ids
