"""Text <-> token ids from a GGUF's tokenizer metadata, matching llama.cpp's tokenization.

``tokenizer.ggml.model`` ``"llama"`` (`model.tokenizer.spm`, SentencePiece-style BPE) or
``"gpt2"`` (`model.tokenizer.bpe`, byte-level BPE), each as llama.cpp's
``src/llama-vocab.cpp``; chat messages render through `model.tokenizer.chat`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tokentext import TokenText

from .bpe import GPT2_PRE_TOKENIZERS, build_bpe
from .chat import ChatTemplate, ChatTemplateError, ChatTemplateMissing
from .spm import build_spm
from .vocab import BuiltTokenizer, TokenizerError

PAD_ID_KEY = "tokenizer.ggml.padding_token_id"

__all__ = [
    "GPT2_PRE_TOKENIZERS",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateMissing",
    "Tokenizer",
    "TokenizerError",
]

# ``tokenizer.ggml.model`` -> the builder of its tokenizer
_BUILDERS: dict[str, Callable[[Mapping[str, Any]], BuiltTokenizer]] = {
    "llama": build_spm,
    "gpt2": build_bpe,
}


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
        chat_template: ChatTemplate | None = None,
        pad_id: int | None = None,
    ) -> None:
        """Wraps a built `tokenizers` object; use `from_gguf_metadata` to get one.

        `piece_bytes` (byte-level vocabularies) gives each non-special id's bytes for
        `decode`, which otherwise asks the `tokenizers` decoder (`tokentext.TokenText.of`).
        `chat_template` renders `apply_chat_template`'s messages (None: the model has no
        template). `pad_id` is only reported (`published`).
        """
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._add_bos = add_bos
        self._vocab_size = vocab_size
        self._piece_bytes = piece_bytes
        self._text = TokenText.of(hf, vocab_size, piece_bytes)
        self._chat_template = chat_template
        self._pad_id = pad_id
        self._lock = threading.Lock()

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, default_chat_template: str | None = None
    ) -> Tokenizer:
        """Builds the tokenizer from GGUF key-value metadata (as `model.gguf.reader` returns it).

        Takes about 3 s for Gemma 3's 262,144-token vocabulary, mostly deriving merges.

        Args:
            metadata: GGUF metadata; reads the ``tokenizer.ggml.*`` keys and
                ``tokenizer.chat_template`` (compiled here, once).
            default_chat_template: template text for a GGUF without ``tokenizer.chat_template``.

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
        build = _BUILDERS.get(model) if isinstance(model, str) else None
        if build is None:
            raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported")
        built = build(metadata)
        template = ChatTemplate.from_gguf_metadata(
            metadata, metadata["tokenizer.ggml.tokens"], bos_id=built.bos_id,
            eos_id=built.eos_id, default=default_chat_template,
        )
        return cls(
            built.hf,
            bos_id=built.bos_id,
            eos_id=built.eos_id,
            add_bos=built.add_bos,
            vocab_size=built.vocab_size,
            piece_bytes=built.piece_bytes,
            chat_template=template,
            pad_id=_pad_id(metadata, built.vocab_size),
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

    @property
    def pad_id(self) -> int | None:
        """Padding token id (``tokenizer.ggml.padding_token_id``), or None."""
        return self._pad_id

    def published(self) -> dict[str, Any]:
        """Everything a client needs to tokenize exactly like `encode`, `decode` and `piece`,
        as plain values (``jobs.tokenizer.pack_tokenizer`` packs them for Redis).

        Takes about 0.3 s for Gemma 3 (serializing its `tokenizers` object).

        Returns:
            ``tokenizer_json`` (str, the `tokenizers` object's ``to_str()``: 12 MB for Gemma
            3), ``vocab_size`` (int), ``add_bos`` (bool), ``bos_id``, ``eos_id``, ``pad_id``
            (int or None), ``bos_token``, ``eos_token``, ``pad_token`` (those tokens' text,
            e.g. ``"<bos>"``, or None), ``piece_bytes`` (each id's bytes, or None: see
            `__init__`) and ``chat_template`` (the template's source text, or None).
        """
        ids = {"bos": self._bos_id, "eos": self._eos_id, "pad": self._pad_id}
        return {
            "tokenizer_json": self._hf.to_str(),
            "vocab_size": self._vocab_size,
            "add_bos": self._add_bos,
            **{f"{name}_id": i for name, i in ids.items()},
            **{f"{name}_token": None if i is None else self._hf.id_to_token(i)
               for name, i in ids.items()},
            "piece_bytes": self._piece_bytes,
            "chat_template": None if self._chat_template is None else self._chat_template.source,
        }

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

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The compiled chat template, or None when the model has none."""
        return self._chat_template

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of chat `messages` (see `ChatTemplate.render`).

        Raises:
            ChatTemplateMissing: the model has no chat template.
            ChatTemplateError: the template fails on these messages (its message says why).
        """
        if self._chat_template is None:
            raise ChatTemplateMissing(
                "this model has no chat template (no tokenizer.chat_template in its GGUF): "
                "submit a prompt or token ids instead of messages"
            )
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of chat `messages`: `render_chat`, then one `encode` with special tokens
        parsed and no BOS added, since a template writes its own ``bos_token`` (as
        transformers' ``apply_chat_template(tokenize=True)``, which encodes with
        ``add_special_tokens=False``).

        Args:
            messages: ``[{"role": str, "content": str}, ...]``, oldest first.
            add_generation_prompt: end with the opening of the assistant's turn.

        Returns:
            The token ids.

        Raises:
            ChatTemplateMissing, ChatTemplateError: as `render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_bos=False, parse_special=True)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of a token id sequence, as llama.cpp's ``detokenize(ids, special=True)``
        (`tokentext.TokenText.decode`).

        Control tokens (BOS, EOS, ``<start_of_turn>``, ...) give their text; byte tokens are
        joined into UTF-8 characters (an invalid byte sequence becomes U+FFFD). For ``"gpt2"``
        vocabularies every normal token is mapped back from GPT-2's byte alphabet; spaces are
        kept as they are (no clean-up of spaces before punctuation).

        Args:
            ids: token ids.
            skip_special_tokens: leave control tokens out (llama.cpp's ``special=False``).

        Returns:
            The text. ``decode(encode(t, add_bos=False))`` gives `t` back, except that for
            ``"llama"`` vocabularies a literal ``"▁"`` comes back as a space, and the space
            llama.cpp prepends to each text fragment when ``tokenizer.ggml.add_space_prefix``
            is on (Llama 2, Mistral; not Gemma 3) stays in the text.

        Raises:
            TokenizerError: an id is outside ``0 .. vocab_size - 1``.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise TokenizerError(f"token id {bad} is outside 0..{self._vocab_size - 1}")
        return self._text.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """Text of one token alone (``" Paris"``, ``"\\n\\n"``, ``"<end_of_turn>"``).

        Matches llama.cpp's ``token_to_piece(id, special=True)``: control tokens give their
        text; a lone byte token that is not a whole UTF-8 character gives U+FFFD.

        Args:
            token_id: a token id.

        Returns:
            The token's text.

        Raises:
            TokenizerError: `token_id` is outside ``0 .. vocab_size - 1``.
        """
        return self.decode([token_id])


def _pad_id(metadata: Mapping[str, Any], vocab_size: int) -> int | None:
    # informational only, so an id outside the vocabulary is dropped rather than refused
    value = metadata.get(PAD_ID_KEY)
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None
