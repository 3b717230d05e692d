"""Chat messages -> prompt text with a model's Jinja chat template, as transformers renders it.

As transformers' ``apply_chat_template`` (``src/transformers/utils/chat_template_utils.py``,
``_compile_jinja_template``): a sandboxed jinja2 environment with its globals and ``tojson``
(`_environment`); what a template raises while it renders becomes a `ChatTemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .vocab import TokenizerError

TEMPLATE_KEY = "tokenizer.chat_template"
TEMPLATES_DIR = Path(__file__).parent / "templates"

# What a template may raise while rendering besides jinja2's own errors: an operator on the
# wrong types ("a" + 1), an out-of-range index in Python code it calls, the sandbox's range
# cap, a macro that calls itself without end.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError,
                  RecursionError)


class ChatTemplateError(TokenizerError):
    """A chat template could not render the messages: it called ``raise_exception``, the
    sandbox refused an operation (``__class__``, mutating a list), or it does not parse.
    The message is the template's own."""


class ChatTemplateMissing(ChatTemplateError):
    """The model has no chat template (no ``tokenizer.chat_template`` in its GGUF)."""


class _RaisedByTemplate(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises inside jinja2."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: jinja2's built-in one HTML-escapes <, >, & and '
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def builtin_template(name: str) -> str:
    """The text of ``templates/<name>.jinja``, for a GGUF without
    ``tokenizer.chat_template``: the Gemma 3 270M GGUF this project ships carries none, so
    the registry gives it ``"gemma3"`` (the Gemma 3 turn format).

    Raises:
        ChatTemplateMissing: there is no such built-in template.
    """
    path = TEMPLATES_DIR / f"{name}.jinja"
    if not path.is_file():
        raise ChatTemplateMissing(f"no built-in chat template {name!r}")
    return path.read_text(encoding="utf-8")


class ChatTemplate:
    """A chat template compiled once, rendered for any number of conversations.

    Rendering is thread-safe (a compiled jinja2 template holds no per-render state).

    Args:
        source: the Jinja template text.
        special_tokens: template variables naming the vocabulary's special tokens, e.g.
            ``{"bos_token": "<bos>", "eos_token": "<eos>"}``; an absent one is undefined
            in the template (renders as ``""``), as in transformers.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self._special = dict(special_tokens)
        try:
            self._compiled: jinja2.Template | None = _environment().from_string(source)
            self._syntax_error: str | None = None
        except jinja2.TemplateSyntaxError as e:  # kept for `render`: a job fails, not a load
            self._compiled, self._syntax_error = None, f"line {e.lineno}: {e.message}"

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tokens: Sequence[str], *,
                           bos_id: int | None, eos_id: int | None,
                           default: str | None = None) -> ChatTemplate | None:
        """The GGUF's ``tokenizer.chat_template``, else `default`, else None.

        Args:
            metadata: GGUF metadata.
            tokens: the vocabulary (``tokenizer.ggml.tokens``), for the special-token strings.
            bos_id, eos_id: special token ids, or None when the vocabulary names none.
            default: template text for a model whose GGUF has none.
        """
        source = metadata.get(TEMPLATE_KEY) or default
        if not source:
            return None
        special = {name: tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", eos_id))
                   if i is not None}
        return cls(str(source), special)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`.

        Args:
            messages: ``[{"role": str, "content": str}, ...]``, oldest first.
            add_generation_prompt: end with the opening of the assistant's turn (what the
                template does with its ``add_generation_prompt`` variable).

        Returns:
            The rendered text, special tokens written out (e.g. ``"<bos><start_of_turn>"``).

        Raises:
            ChatTemplateError: the template does not parse, calls ``raise_exception``, is
                refused by the sandbox, or fails on these messages; the message says why.
        """
        if self._compiled is None:
            raise ChatTemplateError(f"the chat template does not parse: {self._syntax_error}")
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=bool(add_generation_prompt),
                **self._special,
            )
        except _RENDER_ERRORS as e:
            raise ChatTemplateError(f"chat template: {e}") from e
