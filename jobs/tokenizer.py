"""A model's tokenizer as its workers publish it, for clients that tokenize without the model.

Workers publish ``model.tokenizer.Tokenizer.published()`` under ``keys.tokenizer(sha256)``
with `pack_tokenizer`; `ServedTokenizer.from_blob` rebuilds a tokenizer that gives the same
ids, text and pieces as the worker's (the HTTP gateway's /tokenize, /detokenize,
/tokenizer_info and echo logprobs). The blob is msgpack: a format number, the plain fields
and the `tokenizers` JSON compressed with zlib. Building needs the `tokenizers` package (the
``gateway`` extra), imported on first use so ``import jobs`` never needs it.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import msgpack

from tokentext.tokenizer import TokenizerBase

from .errors import InvalidRequest, TokenizerMalformed, TokenizerUnavailable, TokenOutOfRange
from .serializer import packb, unpackb
from .values import utf8_size

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

# Version of the blob's layout; a reader refuses a newer one (TokenizerUnavailable).
FORMAT = 1
# The inflated JSON may be at most this many bytes (Gemma 3's is 12 MB), so a garbled blob
# cannot exhaust a client's memory.
MAX_JSON_BYTES = 512 * 2**20
# The fields besides the JSON, and the types each may hold.
_ID, _TEXT = (int, type(None)), (str, type(None))
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "vocab_size": (int,),
    "add_bos": (bool,),
    "bos_id": _ID,
    "eos_id": _ID,
    "pad_id": _ID,
    "bos_token": _TEXT,
    "eos_token": _TEXT,
    "pad_token": _TEXT,
    "piece_bytes": (list, type(None)),
    "chat_template": _TEXT,
}
_JSON_FIELD = "tokenizer_json_zlib"


def pack_tokenizer(fields: dict[str, Any]) -> bytes:
    """The blob workers publish: `fields` (``model.tokenizer.Tokenizer.published()``) as
    msgpack with their ``tokenizer_json`` zlib-compressed (sizes and time: docs/benchmarks.md).

    Raises:
        TokenizerMalformed: a field is missing or of the wrong type.
    """
    _check_fields(fields)
    if not isinstance(fields.get("tokenizer_json"), str):
        raise TokenizerMalformed("tokenizer fields lack the 'tokenizer_json' string")
    packed = {name: fields[name] for name in FIELD_TYPES}
    packed[_JSON_FIELD] = zlib.compress(fields["tokenizer_json"].encode("utf-8"))
    return packb({"format": FORMAT, **packed})


def _check_fields(fields: Any) -> None:
    if not isinstance(fields, dict):
        raise TokenizerMalformed(f"tokenizer fields have type {type(fields).__name__}, not a map")
    for name, types in FIELD_TYPES.items():
        if name not in fields:
            raise TokenizerMalformed(f"tokenizer field {name!r} is missing")
        value = fields[name]
        # bool is an int in Python: an id or size given as True is still wrong
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise TokenizerMalformed(
                f"tokenizer field {name!r} has type {type(value).__name__}")
    n = fields["vocab_size"]
    if n < 1:
        raise TokenizerMalformed(f"tokenizer vocab_size {n} is not positive")
    for name in ("bos_id", "eos_id", "pad_id"):
        if fields[name] is not None and not 0 <= fields[name] < n:
            raise TokenizerMalformed(f"tokenizer {name} {fields[name]} is outside 0..{n - 1}")
    pieces = fields["piece_bytes"]
    if pieces is not None and (len(pieces) != n or not all(isinstance(p, bytes) for p in pieces)):
        raise TokenizerMalformed(f"tokenizer piece_bytes is not {n} byte strings")


def _inflate(data: Any) -> str:
    if not isinstance(data, bytes):
        raise TokenizerMalformed(f"tokenizer field {_JSON_FIELD!r} is missing or not bytes")
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(data, MAX_JSON_BYTES)
    except zlib.error as e:
        raise TokenizerMalformed(f"tokenizer JSON does not inflate: {e}") from e
    if inflater.unconsumed_tail:
        raise TokenizerMalformed(f"tokenizer JSON inflates past {MAX_JSON_BYTES} bytes")
    if not inflater.eof:
        raise TokenizerMalformed("tokenizer JSON is truncated")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerMalformed(f"tokenizer JSON is not UTF-8: {e}") from e


def _build_hf(text: str) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:
        raise ImportError("ServedTokenizer needs the tokenizers package: "
                          "pip install 'prefillq[gateway]'") from e
    try:
        return HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on JSON it cannot load
        raise TokenizerMalformed(f"tokenizer JSON does not load: {e}") from e


class ServedTokenizer(TokenizerBase):
    """A worker's tokenizer rebuilt from its published blob: `encode`, `decode`, `piece` and
    `pieces` are those of ``model.tokenizer.Tokenizer`` on the worker
    (`tokentext.tokenizer.TokenizerBase`), so they give exactly its ids and text.

    A bad id raises TokenOutOfRange (outside the vocabulary) or InvalidRequest (not an
    integer). Get one with `from_blob` (or a client's ``tokenizer(model)``).
    """

    OUT_OF_RANGE_ERROR = TokenOutOfRange
    NOT_INTEGER_ERROR = InvalidRequest

    def __init__(self, hf: HFTokenizer, fields: dict[str, Any]) -> None:
        """Wraps a loaded `tokenizers` object and the checked fields of its blob."""
        super().__init__(hf, vocab_size=fields["vocab_size"], add_bos=fields["add_bos"],
                         bos_id=fields["bos_id"], eos_id=fields["eos_id"],
                         pad_id=fields["pad_id"], piece_bytes=fields["piece_bytes"])
        self._fields = fields

    @classmethod
    def from_blob(cls, blob: bytes) -> ServedTokenizer:
        """Rebuild the tokenizer of a published blob (`pack_tokenizer`).

        Takes about 1.5 s for Gemma 3's 5 MB blob, loading the `tokenizers` JSON and reading
        each id's text (`tokentext.TokenText.of`).

        Raises:
            TokenizerMalformed: the blob is not msgpack, lacks a field, holds one of the
                wrong type, or its JSON does not inflate or load.
            TokenizerUnavailable: the blob's format is newer than this client reads.
            ImportError: the `tokenizers` package is not installed.
        """
        try:
            data = unpackb(blob)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise TokenizerMalformed(f"tokenizer blob is not msgpack: {e}") from e
        version = data.get("format") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
            raise TokenizerUnavailable(f"the published tokenizer has format {version}; this "
                                       f"client reads {FORMAT}: upgrade prefillq")
        if version != FORMAT:
            raise TokenizerMalformed(f"tokenizer blob has no format {FORMAT} marker")
        _check_fields(data)
        fields = {name: data[name] for name in FIELD_TYPES}
        return cls(_build_hf(_inflate(data.get(_JSON_FIELD))), fields)

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (e.g. ``"<bos>"``), or None."""
        return self._fields["bos_token"]

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (e.g. ``"<eos>"``), or None."""
        return self._fields["eos_token"]

    @property
    def pad_token(self) -> str | None:
        """Text of the padding token (e.g. ``"<pad>"``), or None."""
        return self._fields["pad_token"]

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source the worker renders messages with, or None."""
        return self._fields["chat_template"]

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """`TokenizerBase.encode`, refusing text UTF-8 cannot encode.

        Raises:
            InvalidRequest: `text` has a lone surrogate.
        """
        utf8_size("text", text)  # a lone surrogate: InvalidRequest, not a TypeError from Rust
        return super().encode(text, add_bos=add_bos, parse_special=parse_special)

    def info(self, model_max_length: int | None = None) -> dict[str, Any]:
        """What GET /tokenizer_info answers: the fields lm-eval's ``RemoteTokenizer`` reads
        (``eos_token``, ``bos_token``, ``pad_token``, ``chat_template``) and the ids and
        settings vLLM's endpoint gives beside them.

        Args:
            model_max_length: the serving context in tokens (``ModelInfo.context_length``),
                included when given; it is a worker's setting, not the tokenizer's.

        Returns:
            A JSON-ready dict; absent tokens and templates are None.
        """
        info = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "add_bos_token": self._add_bos,
            "vocab_size": self._vocab_size,
            "clean_up_tokenization_spaces": False,  # decode keeps spaces as they are
            "chat_template": self.chat_template,
        }
        if model_max_length is not None:
            info["model_max_length"] = model_max_length
        return info


class TokenizerCache:
    """Tokenizers by model sha256 for a sync client: each is built once, by the first caller
    (the others wait on the lock); a build that raises is not kept, so a later call retries."""

    def __init__(self) -> None:
        self._built: dict[str, ServedTokenizer] = {}
        self._lock = threading.Lock()

    def get(self, sha256: str, build: Callable[[], ServedTokenizer]) -> ServedTokenizer:
        """The tokenizer cached for `sha256`, else `build()`'s (errors: `build`'s)."""
        with self._lock:
            if sha256 not in self._built:
                self._built[sha256] = build()
            return self._built[sha256]


class AsyncTokenizerCache:
    """Tokenizers by model sha256 for an asyncio client: concurrent first calls share one
    build task; a caller canceled while waiting leaves it running for the others; a build
    that raises is dropped, so a later call retries."""

    def __init__(self) -> None:
        self._builds: dict[str, asyncio.Future[ServedTokenizer]] = {}

    async def get(self, sha256: str,
                  build: Callable[[], Awaitable[ServedTokenizer]]) -> ServedTokenizer:
        """The tokenizer built for `sha256`, starting `build()` if none is built or building
        (errors: `build`'s)."""
        task = self._builds.get(sha256)
        if task is None:
            task = self._builds[sha256] = asyncio.ensure_future(build())
            task.add_done_callback(partial(self._settled, sha256))
        return await asyncio.shield(task)

    def _settled(self, sha256: str, task: asyncio.Future[ServedTokenizer]) -> None:
        # reading the exception also keeps asyncio from logging it as never retrieved
        if (task.cancelled() or task.exception() is not None) and (
                self._builds.get(sha256) is task):
            del self._builds[sha256]
