"""Text <-> token ids from a GGUF's tokenizer metadata, matching llama.cpp's tokenization.

Only ``tokenizer.ggml.model == "llama"`` (SentencePiece-style BPE with scores and byte
fallback, as in Gemma 3) is supported. It is rebuilt in memory as a `tokenizers` BPE whose
merges come from the vocabulary itself: every split of every token into two tokens, ranked
by the merged token's score (highest first). That reproduces llama.cpp's best-score-first
merge loop; see /work/shared/research/tokenizer_gemma.md for how it was checked.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

# llama.cpp token types (``llama_token_type``), as stored in ``tokenizer.ggml.token_type``.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SPACE_MARK = "\u2581"  # "▁": SentencePiece's stand-in for a space.


class TokenizerError(ValueError):
    """Tokenizer metadata is missing or unsupported, or a token id is out of range."""


class Tokenizer:
    """A GGUF vocabulary's tokenizer: `encode` gives the ids llama.cpp's ``tokenize`` gives.

    Thread-safe: `encode` calls are serialized, since special-token parsing is a setting of
    the underlying `tokenizers` object rather than an argument of its ``encode``.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        vocab_size: int,
    ) -> None:
        """Wraps a built `tokenizers` object; use `from_gguf_metadata` to get one."""
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._add_bos = add_bos
        self._vocab_size = vocab_size
        self._lock = threading.Lock()

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer from GGUF key-value metadata (as `model.loader` returns it).

        Takes about 3 s for Gemma 3's 262,144-token vocabulary, mostly deriving merges.

        Args:
            metadata: GGUF metadata; reads the ``tokenizer.ggml.*`` keys.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: ``tokenizer.ggml.model`` is not ``"llama"``, the tokens are
                missing, the scores or token types differ from them in length, or a
                special-token id is outside the vocabulary.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model == "gpt2":
            raise TokenizerError("tokenizer.ggml.model 'gpt2' is not supported yet")
        if model != "llama":
            raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported")
        tokens, scores, types = _vocab_arrays(metadata)
        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
        unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
        hf = _build_spm_bpe(tokens, scores, types, bos_id=bos_id, unk_id=unk_id)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        return cls(hf, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, vocab_size=len(tokens))

    @property
    def vocab_size(self) -> int:
        """Number of token ids (ids are ``0 .. vocab_size - 1``)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id, or None when the vocabulary names none."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id, or None when the vocabulary names none."""
        return self._eos_id

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Tokenizes `text` like llama.cpp's ``tokenize(text, add_bos, special=parse_special)``.

        Args:
            text: the text, taken verbatim (no space is prepended).
            add_bos: prepend the BOS id; None follows ``tokenizer.ggml.add_bos_token``.
                Ignored when the vocabulary has no BOS token.
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

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a token id sequence.

        Control tokens (BOS, EOS, ``<start_of_turn>``, ...) render as nothing; byte tokens are
        joined into UTF-8 characters (an invalid byte sequence becomes U+FFFD).

        Args:
            ids: token ids.

        Returns:
            The text. ``decode(encode(t, add_bos=False))`` gives `t` back, except that a
            literal ``"▁"`` comes back as a space.

        Raises:
            TokenizerError: an id is outside ``0 .. vocab_size - 1``.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise TokenizerError(f"token id {bad} is outside 0..{self._vocab_size - 1}")
        return self._hf.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """Text of one token as a reader would see it (``" Paris"``, ``"\\n\\n"``, ``","``).

        Matches llama.cpp's ``token_to_piece(id, special=False)``: control tokens give ``""``;
        a lone byte token that is not a whole UTF-8 character gives U+FFFD.

        Args:
            token_id: a token id.

        Returns:
            The token's text.

        Raises:
            TokenizerError: `token_id` is outside ``0 .. vocab_size - 1``.
        """
        return self.decode([token_id])


def _vocab_arrays(metadata: Mapping[str, Any]) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and token types; absent scores and types default as in llama.cpp."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) == 0:
        raise TokenizerError("missing metadata key 'tokenizer.ggml.tokens'")
    tokens = [str(t) for t in tokens]
    scores = metadata.get("tokenizer.ggml.scores")
    types = metadata.get("tokenizer.ggml.token_type")
    scores = [0.0] * len(tokens) if scores is None else [float(x) for x in scores]
    types = [TOKEN_TYPE_NORMAL] * len(tokens) if types is None else [int(x) for x in types]
    if not len(tokens) == len(scores) == len(types):
        raise TokenizerError(
            f"tokenizer arrays differ in length: {len(tokens)} tokens, "
            f"{len(scores)} scores, {len(types)} token types"
        )
    return tokens, scores, types


def _optional_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    """Token id stored under `key`, or None when absent. Raises TokenizerError if invalid."""
    value = metadata.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n_tokens:
        raise TokenizerError(f"{key} = {value} is outside the {n_tokens}-token vocabulary")
    return int(value)


def _build_spm_bpe(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    bos_id: int | None,
    unk_id: int | None,
) -> HFTokenizer:
    """A `tokenizers` BPE that tokenizes like llama.cpp's SPM tokenizer over this vocab."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _score_ranked_merges(tokens, scores, vocab)
    unk = tokens[unk_id] if unk_id is not None else None
    hf = HFTokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # llama.cpp's SPM path only escapes spaces: no NFKC, no prefix space, no word splitting.
    hf.normalizer = normalizers.Replace(" ", SPACE_MARK)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # llama.cpp cuts user-defined tokens out of the raw text before SPM even without special
    # parsing (this is how "  " becomes one space-run token), so they are added tokens too.
    hf.add_special_tokens(_added_tokens(tokens, types, TOKEN_TYPE_CONTROL, special=True))
    hf.add_tokens(_added_tokens(tokens, types, TOKEN_TYPE_USER_DEFINED, special=False))
    if bos_id is not None:
        bos = tokens[bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    return hf


def _added_tokens(
    tokens: list[str], types: list[int], token_type: int, *, special: bool
) -> list[AddedToken]:
    """The tokens of `token_type`, matched verbatim on the raw (unnormalized) text."""
    return [
        AddedToken(t, special=special, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == token_type
    ]


def _score_ranked_merges(
    tokens: list[str], scores: list[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every (left, right) token pair that concatenates to a token, best first.

    llama.cpp repeatedly merges the adjacent pair whose concatenation has the highest score,
    so a merge's rank is its merged token's score, descending. Equal scores (control and
    user-defined tokens) are ordered by merged, left, then right id so the order is fixed.
    """
    merged, left, right = _token_splits(tokens, vocab)
    score = np.asarray(scores, dtype=np.float64)[merged]
    order = np.lexsort((right, left, merged, -score))
    return [
        (tokens[a], tokens[b])
        for a, b in zip(left[order].tolist(), right[order].tolist(), strict=True)
    ]


def _token_splits(
    tokens: list[str], vocab: Mapping[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(merged, left, right) id arrays: each way of splitting a token into two tokens."""
    get = vocab.get
    found = [
        (i, a, b)
        for i, t in enumerate(tokens)
        for k in range(1, len(t))
        if (a := get(t[:k])) is not None and (b := get(t[k:])) is not None
    ]
    splits = np.array(found, dtype=np.int64).reshape(-1, 3)
    return splits[:, 0], splits[:, 1], splits[:, 2]
