"""What both tokenizer paths read from a GGUF: token types, the vocabulary arrays, special ids.

Token types are llama.cpp's ``llama_token_type`` values as stored in
``tokenizer.ggml.token_type`` (llama.cpp ``src/llama-vocab.cpp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6  # SentencePiece byte-fallback tokens ``<0x00>`` .. ``<0xFF>``


# Token texts llama.cpp makes control tokens whatever their GGUF type says, when it loads a
# vocabulary (src/llama-vocab.cpp, llama_vocab::impl::load, "auto-detect special tokens by
# text"): these end-of-generation markers always ...
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip
# ... and these fill-in-the-middle markers when the GGUF gives no id of their kind (llama.cpp
# then takes the first it meets; a vocabulary rarely has two of one kind).
_FIM_TEXTS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"): (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"): (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"): (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
        "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    ("tokenizer.ggml.fim_pad_token_id",): (
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("tokenizer.ggml.fim_rep_token_id",): (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("tokenizer.ggml.fim_sep_token_id",): ("<|file_sep|>",),
}  # fmt: skip


class TokenizerError(ValueError):
    """Tokenizer metadata is missing or unsupported, or a token id is out of range."""


@dataclass(frozen=True)
class BuiltTokenizer:
    """A `tokenizers` object and the settings `model.tokenizer.Tokenizer` wraps it with.

    Attributes:
        hf: the built `tokenizers.Tokenizer`.
        bos_id: BOS token id, or None when the vocabulary names none.
        eos_id: EOS token id, or None.
        add_bos: whether `encode` prepends BOS by default.
        vocab_size: number of token ids.
        piece_bytes: each id's bytes for decoding (byte-level vocabularies), or None to let
            the `tokenizers` decoder decode.
    """

    hf: HFTokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    vocab_size: int
    piece_bytes: list[bytes] | None = None


def vocab_arrays(metadata: Mapping[str, Any]) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and token types; absent scores and types default as in llama.cpp,
    and the tokens llama.cpp makes control tokens by their text are control tokens
    (`llama_cpp_types`).

    Raises:
        TokenizerError: the tokens are missing, or the arrays differ in length.
    """
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
    return tokens, scores, llama_cpp_types(tokens, types, metadata)


def llama_cpp_types(tokens: list[str], types: list[int], metadata: Mapping[str, Any]) -> list[int]:
    """`types` with the end-of-generation and fill-in-the-middle markers that llama.cpp makes
    control tokens by their text (e.g. Qwen 2's normal ``</s>``, Gemma 3's user-defined one):
    they are then matched only with special parsing, and decoded as nothing without it.

    llama.cpp's other re-typings are for vocabularies this package refuses (gpt-oss's and
    Solar Open's pre-tokenizers, Gemma 4's and PLaMo 2's tokenizer models).
    """
    control = set(_END_OF_GENERATION_TEXTS)
    for keys, texts in _FIM_TEXTS.items():
        if not any(key in metadata for key in keys):
            control.update(texts)
    keep = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    return [TOKEN_TYPE_CONTROL if ty not in keep and token in control else ty
            for token, ty in zip(tokens, types, strict=True)]


def optional_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    """Token id stored under `key`, or None when absent. Raises TokenizerError if invalid."""
    value = metadata.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n_tokens:
        raise TokenizerError(f"{key} = {value} is outside the {n_tokens}-token vocabulary")
    return int(value)


def with_added_tokens_and_bos(
    hf: HFTokenizer,
    tokens: list[str],
    types: list[int],
    special_types: set[int],
    bos_id: int | None,
) -> HFTokenizer:
    """Add `special_types` tokens as special (matched only with special parsing), user-defined
    tokens as always-matched added tokens, and BOS as a template, to `hf`.

    Added tokens are matched verbatim on the raw (unnormalized) text.
    """
    hf.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in special_types
        ]
    )
    hf.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == TOKEN_TYPE_USER_DEFINED
        ]
    )
    if bos_id is not None:
        bos = tokens[bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    return hf
