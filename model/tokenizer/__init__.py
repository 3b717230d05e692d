"""Text <-> token ids from a GGUF's tokenizer metadata, matching llama.cpp's tokenization.

``tokenizer.ggml.model`` ``"llama"`` (`model.tokenizer.spm`, SentencePiece-style BPE) or
``"gpt2"`` (`model.tokenizer.bpe`, byte-level BPE), each as llama.cpp's
``src/llama-vocab.cpp``; chat messages render through `model.tokenizer.chat`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tokentext.tokenizer import TokenizerBase

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


class Tokenizer(TokenizerBase):
    """A GGUF vocabulary's tokenizer: `encode` gives the ids llama.cpp's ``tokenize`` gives,
    `decode` its text (`tokentext.tokenizer.TokenizerBase`, which clients share).

    `decode`, `piece` and `pieces` raise TokenizerError for an id outside the vocabulary
    (TypeError for one that is not an integer).
    """

    OUT_OF_RANGE_ERROR = TokenizerError

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
        super().__init__(hf, vocab_size=vocab_size, add_bos=add_bos, bos_id=bos_id,
                         eos_id=eos_id, pad_id=pad_id, piece_bytes=piece_bytes)
        self._piece_bytes = piece_bytes
        self._chat_template = chat_template

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


def _pad_id(metadata: Mapping[str, Any], vocab_size: int) -> int | None:
    # informational only, so an id outside the vocabulary is dropped rather than refused
    value = metadata.get(PAD_ID_KEY)
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None
