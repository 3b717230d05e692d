"""``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with scores and byte fallback.

llama.cpp's ``llm_tokenizer_spm`` (``src/llama-vocab.cpp``) repeatedly merges the adjacent
pair whose concatenation is the highest-scoring token. The same result comes from a
`tokenizers` BPE whose merges are every split of every token into two tokens, ranked by the
merged token's score (highest first). Checked against llama.cpp's token ids for Gemma 3 270M
(tests/data/gemma3-270m-llamacpp.json, tests/model/test_tokenizer.py) and for a Llama-2-style
vocabulary with a space prefix (tests/model/test_tokenizer_spm.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers
from tokenizers.models import BPE

from .vocab import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    BuiltTokenizer,
    optional_id,
    vocab_arrays,
    with_added_tokens_and_bos,
)

SPACE_MARK = "\u2581"  # "▁": SentencePiece's stand-in for a space.
ADD_SPACE_PREFIX_KEY = "tokenizer.ggml.add_space_prefix"


def build_spm(metadata: Mapping[str, Any]) -> BuiltTokenizer:
    """The SentencePiece-style tokenizer of a GGUF's ``tokenizer.ggml.*`` metadata.

    Raises:
        TokenizerError: the tokens are missing, the arrays differ in length, or a special
            token id is outside the vocabulary.
    """
    tokens, scores, types = vocab_arrays(metadata)
    bos_id = optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
    eos_id = optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
    unk_id = optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
    # llama.cpp's default for "llama" vocabularies (Llama 2, Mistral); Gemma 3's GGUF says false
    space_prefix = bool(metadata.get(ADD_SPACE_PREFIX_KEY, True))
    hf = _build_spm_bpe(
        tokens, scores, types, bos_id=bos_id, unk_id=unk_id, space_prefix=space_prefix
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    return BuiltTokenizer(hf, bos_id, eos_id, add_bos, len(tokens))


def _build_spm_bpe(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    bos_id: int | None,
    unk_id: int | None,
    space_prefix: bool,
) -> HFTokenizer:
    """A `tokenizers` BPE that tokenizes like llama.cpp's SPM tokenizer over this vocab."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _score_ranked_merges(tokens, scores, vocab)
    unk = tokens[unk_id] if unk_id is not None else None
    hf = HFTokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # llama.cpp's SPM path (llama_vocab::impl::tokenize) only escapes spaces, after prepending
    # one to every text fragment when add_space_prefix is set: no NFKC, no word splitting. Every
    # fragment is either the first or follows a special token, which is when llama.cpp prepends;
    # `tokenizers` normalizes each fragment between added tokens separately, so Prepend matches.
    escape = normalizers.Replace(" ", SPACE_MARK)
    hf.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE_MARK), escape]) if space_prefix else escape
    )
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # llama.cpp cuts control and unknown tokens (``<unk>``) out of the text only with special
    # parsing, user-defined ones always (this is how "  " becomes one space-run token).
    return with_added_tokens_and_bos(
        hf, tokens, types, {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN}, bos_id
    )


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
