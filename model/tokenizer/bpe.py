"""``tokenizer.ggml.model == "gpt2"``: byte-level BPE with ``tokenizer.ggml.merges``.

As in DeepSeek V3/V4, Llama 3, Qwen 2 and SmolLM2. The text is split by the regexes llama.cpp's
``llm_tokenizer_bpe`` (``src/llama-vocab.cpp``) uses for the ``tokenizer.ggml.pre`` value
(see `GPT2_PRE_TOKENIZERS`), mapped to GPT-2's byte alphabet, then merged by merge rank.
Checked against llama.cpp's ``llama-tokenize`` on a vocab-only DeepSeek-style GGUF
(tests/data/gpt2-vocab-deepseek3.gguf, tests/model/test_tokenizer_gpt2.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from .vocab import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    BuiltTokenizer,
    TokenizerError,
    optional_id,
    vocab_arrays,
    with_added_tokens_and_bos,
)

# The Split regexes of llama.cpp's ``llm_tokenizer_bpe`` (src/llama-vocab.cpp), per pre-tokenizer
# kind. Each regex is applied in turn to the pieces the previous one left, keeping both the
# matches and the text between them as pieces (`tokenizers`' "isolated" Split behaviour).
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
GPT2_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # LLAMA_VOCAB_PRE_TYPE_GPT2
    "gpt-2": (_GPT2_REGEX,),
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM (llama.cpp's STARCODER and REFACT too): digits one at a
    # time, then GPT-2's split
    "smollm": (r"\p{N}", _GPT2_REGEX),
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
    "smollm": "smollm",
}
# Kinds for which llama.cpp looks a whole pre-token up in the vocabulary before merging.
_GPT2_PRE_IGNORE_MERGES = frozenset({"llama3"})
# Kinds that add BOS when ``tokenizer.ggml.add_bos_token`` is absent.
_GPT2_PRE_ADD_BOS = frozenset({"llama3"})


def build_bpe(metadata: Mapping[str, Any]) -> BuiltTokenizer:
    """The byte-level BPE tokenizer of a GGUF's ``tokenizer.ggml.*`` metadata.

    Raises:
        TokenizerError: ``tokenizer.ggml.pre`` is not one of `GPT2_PRE_TOKENIZERS` (or an
            alias llama.cpp accepts), the tokens or merges are missing or malformed, or a
            special token id is outside the vocabulary.
    """
    pre = metadata.get("tokenizer.ggml.pre")
    pre = "default" if pre is None or str(pre) == "" else str(pre)  # llama.cpp: "default"
    kind = _GPT2_PRE_ALIASES.get(pre)
    if kind is None:
        known = ", ".join(sorted(_GPT2_PRE_ALIASES))
        raise TokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported for tokenizer.ggml.model 'gpt2' "
            f"(supported: {known})"
        )
    tokens, _, types = vocab_arrays(metadata)
    merges = _gpt2_merges(metadata)
    bos_id = optional_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
    eos_id = optional_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
    hf = _build_byte_bpe(tokens, types, merges, kind=kind, bos_id=bos_id)
    # llama.cpp's BPE default is no BOS, except for the Llama 3 family; the key overrides.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    add_bos = kind in _GPT2_PRE_ADD_BOS if add_bos is None else bool(add_bos)
    pieces = _byte_level_pieces(tokens, types)
    return BuiltTokenizer(hf, bos_id, eos_id, add_bos, len(tokens), piece_bytes=pieces)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 ``src/encoder.py``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def _byte_level_pieces(tokens: list[str], types: list[int]) -> list[bytes]:
    """Each token's bytes as llama.cpp's ``token_to_piece(id, special=False)`` gives them.

    Normal tokens are mapped back from GPT-2's byte alphabet (a character outside it stands
    for itself); user-defined tokens are stored as plain text; control and unknown tokens
    render as nothing.
    """
    to_byte = {c: bytes([b]) for b, c in bytes_to_unicode().items()}
    pieces = []
    for token, ty in zip(tokens, types, strict=True):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            pieces.append(b"")
        elif ty == TOKEN_TYPE_USER_DEFINED:
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(b"".join(to_byte.get(c) or c.encode("utf-8") for c in token))
    return pieces


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
    return with_added_tokens_and_bos(
        hf, tokens, types, {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN}, bos_id
    )
