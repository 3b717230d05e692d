"""Text <-> token ids from a GGUF's tokenizer metadata, matching llama.cpp's tokenization.

Two ``tokenizer.ggml.model`` values are supported:

- ``"llama"`` (SentencePiece-style BPE with scores and byte fallback, as in Gemma 3). It is
  rebuilt in memory as a `tokenizers` BPE whose merges come from the vocabulary itself: every
  split of every token into two tokens, ranked by the merged token's score (highest first).
  That reproduces llama.cpp's best-score-first merge loop; see
  /work/shared/research/tokenizer_gemma.md for how it was checked.
- ``"gpt2"`` (byte-level BPE with ``tokenizer.ggml.merges``, as in DeepSeek V3/V4, Llama 3,
  Qwen 2). The text is split by the regexes llama.cpp's ``llm_tokenizer_bpe`` uses for the
  ``tokenizer.ggml.pre`` value (see `GPT2_PRE_TOKENIZERS`), mapped to GPT-2's byte
  alphabet, then merged by merge rank. Checked against llama.cpp's ``llama-tokenize`` on a
  vocab-only DeepSeek-style GGUF (tests/test_tokenizer_gpt2.py).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

# llama.cpp token types (``llama_token_type``), as stored in ``tokenizer.ggml.token_type``.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
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
        piece_bytes: list[bytes] | None = None,
    ) -> None:
        """Wraps a built `tokenizers` object; use `from_gguf_metadata` to get one.

        `piece_bytes` (byte-level vocabularies) gives each id's bytes for `decode`, which
        otherwise asks the `tokenizers` decoder.
        """
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._add_bos = add_bos
        self._vocab_size = vocab_size
        self._piece_bytes = piece_bytes
        self._lock = threading.Lock()

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer from GGUF key-value metadata (as `model.gguf.reader` returns it).

        Takes about 3 s for Gemma 3's 262,144-token vocabulary, mostly deriving merges.

        Args:
            metadata: GGUF metadata; reads the ``tokenizer.ggml.*`` keys.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: ``tokenizer.ggml.model`` is not ``"llama"`` or ``"gpt2"``, the
                tokens are missing, the scores or token types differ from them in length, a
                special-token id is outside the vocabulary, or (``"gpt2"``) the merges are
                missing or malformed or ``tokenizer.ggml.pre`` is not one of
                `GPT2_PRE_TOKENIZERS`.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model == "gpt2":
            return cls._from_gpt2_metadata(metadata)
        if model != "llama":
            raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported")
        tokens, scores, types = _vocab_arrays(metadata)
        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
        unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
        hf = _build_spm_bpe(tokens, scores, types, bos_id=bos_id, unk_id=unk_id)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        return cls(hf, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, vocab_size=len(tokens))

    @classmethod
    def _from_gpt2_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) case of `from_gguf_metadata`."""
        pre = metadata.get("tokenizer.ggml.pre")
        pre = "default" if pre is None or str(pre) == "" else str(pre)  # llama.cpp: "default"
        kind = _GPT2_PRE_ALIASES.get(pre)
        if kind is None:
            known = ", ".join(sorted(_GPT2_PRE_ALIASES))
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported for tokenizer.ggml.model 'gpt2' "
                f"(supported: {known})"
            )
        tokens, _, types = _vocab_arrays(metadata)
        merges = _gpt2_merges(metadata)
        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
        hf = _build_byte_bpe(tokens, types, merges, kind=kind, bos_id=bos_id)
        # llama.cpp's BPE default is no BOS, except for the Llama 3 family; the key overrides.
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_bos = kind in _GPT2_PRE_ADD_BOS if add_bos is None else bool(add_bos)
        return cls(
            hf,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            vocab_size=len(tokens),
            piece_bytes=_byte_level_pieces(tokens, types),
        )

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
        joined into UTF-8 characters (an invalid byte sequence becomes U+FFFD). For ``"gpt2"``
        vocabularies every normal token is mapped back from GPT-2's byte alphabet; spaces are
        kept as they are (no clean-up of spaces before punctuation).

        Args:
            ids: token ids.

        Returns:
            The text. ``decode(encode(t, add_bos=False))`` gives `t` back, except that for
            ``"llama"`` vocabularies a literal ``"▁"`` comes back as a space.

        Raises:
            TokenizerError: an id is outside ``0 .. vocab_size - 1``.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise TokenizerError(f"token id {bad} is outside 0..{self._vocab_size - 1}")
        if self._piece_bytes is not None:
            pieces = self._piece_bytes
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
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
    return _with_added_tokens_and_bos(hf, tokens, types, {TOKEN_TYPE_CONTROL}, bos_id)


def _added_tokens(
    tokens: list[str], types: list[int], token_type: int, *, special: bool
) -> list[AddedToken]:
    """The tokens of `token_type`, matched verbatim on the raw (unnormalized) text."""
    return [
        AddedToken(t, special=special, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == token_type
    ]


def _with_added_tokens_and_bos(
    hf: HFTokenizer,
    tokens: list[str],
    types: list[int],
    special_types: set[int],
    bos_id: int | None,
) -> HFTokenizer:
    """Add `special_types` tokens as special (matched only with special parsing), user-defined
    tokens as always-matched added tokens, and BOS as a template, to `hf`."""
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False)
         for t, ty in zip(tokens, types, strict=True) if ty in special_types]
    )
    hf.add_tokens(_added_tokens(tokens, types, TOKEN_TYPE_USER_DEFINED, special=False))
    if bos_id is not None:
        bos = tokens[bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    return hf


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


# --- "gpt2": byte-level BPE ------------------------------------------------------------------

# The Split regexes of llama.cpp's ``llm_tokenizer_bpe`` (src/llama-vocab.cpp), per pre-tokenizer
# kind. Each regex is applied in turn to the pieces the previous one left, keeping both the
# matches and the text between them as pieces (`tokenizers`' "isolated" Split behaviour).
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
    # LLAMA_VOCAB_PRE_TYPE_GPT2
    "gpt-2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3 (also merges whole pre-tokens that are tokens first)
    "llama3": (_LLAMA3_REGEX,),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2: as Llama 3 but digits one at a time
    "qwen2": (_LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"),),
    # LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM: digit groups of up to 3, CJK/kana runs, then words
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
        r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
}
"""Pre-tokenizer kind -> its Split regexes, as in llama.cpp."""

# ``tokenizer.ggml.pre`` value -> pre-tokenizer kind (the names llama.cpp accepts for it, plus
# "gpt2" as a spelling of "gpt-2").
_GPT2_PRE_ALIASES: dict[str, str] = {
    "default": "default",
    "gpt-2": "gpt-2",
    "gpt2": "gpt-2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "deepseek-v3": "deepseek-v3",
}
# Kinds for which llama.cpp looks a whole pre-token up in the vocabulary before merging.
_GPT2_PRE_IGNORE_MERGES = frozenset({"llama3"})
# Kinds that add BOS when ``tokenizer.ggml.add_bos_token`` is absent.
_GPT2_PRE_ADD_BOS = frozenset({"llama3"})


def _byte_level_pieces(tokens: list[str], types: list[int]) -> list[bytes]:
    """Each token's bytes as llama.cpp's ``token_to_piece(id, special=False)`` gives them.

    Normal tokens are mapped back from GPT-2's byte alphabet (a character outside it stands
    for itself); user-defined tokens are stored as plain text; control and unknown tokens
    render as nothing.
    """
    to_byte = {c: bytes([b]) for b, c in _gpt2_byte_chars().items()}
    pieces = []
    for token, ty in zip(tokens, types, strict=True):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            pieces.append(b"")
        elif ty == TOKEN_TYPE_USER_DEFINED:
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(b"".join(to_byte.get(c) or c.encode("utf-8") for c in token))
    return pieces


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 src/encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def _gpt2_merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as (left, right) pairs, highest priority first.

    Each merge is "left right"; as in llama.cpp, the split is at the first space after the
    first character (so a left part may itself be a space).
    """
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("missing metadata key 'tokenizer.ggml.merges'")
    pairs = []
    for i, merge in enumerate(merges):
        merge = str(merge)
        pos = merge.find(" ", 1)
        if pos < 0:
            raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {merge!r} has no space")
        pairs.append((merge[:pos], merge[pos + 1 :]))
    return pairs


def _build_byte_bpe(
    tokens: list[str],
    types: list[int],
    merges: list[tuple[str, str]],
    *,
    kind: str,
    bos_id: int | None,
) -> HFTokenizer:
    """A `tokenizers` byte-level BPE that tokenizes like llama.cpp's BPE tokenizer."""
    vocab = {token: i for i, token in enumerate(tokens)}
    # `tokenizers` refuses merges whose parts or result are not tokens, so they are dropped;
    # converted vocabularies have none (llama.cpp would spell such a result in byte tokens).
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=kind in _GPT2_PRE_IGNORE_MERGES))
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
        for r in GPT2_PRE_TOKENIZERS[kind]
    ]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *splits,
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    # llama.cpp cuts control and unknown tokens out of the text only with special parsing,
    # user-defined ones always.
    return _with_added_tokens_and_bos(
        hf, tokens, types, {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN}, bos_id
    )
