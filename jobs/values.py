"""Checks of one submitted value, each raising `InvalidRequest` that names the field.

Integers are real ``int``s (numpy integer scalars too, through ``__index__``): a bool, a
float or a numeric string is refused, never rounded or parsed.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from .defaults import MAX_NAME_BYTES
from .errors import InvalidRequest

# a bad value is quoted in the error at most this long (it may be a 10 MB string)
_SHOWN_CHARS = 60


def utf8_size(name: str, text: str) -> int:
    """Bytes of `text` in UTF-8. Raises InvalidRequest naming `name` on a lone surrogate."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{name} is not valid text: {text[e.start]!r} at index {e.start} "
                             "is a lone surrogate, which UTF-8 cannot encode") from e


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def integer(name: str, value: Any) -> int:
    """`value` as an int if it is one (or a numpy integer). Raises InvalidRequest naming
    `name` for anything else: a bool, a float (never truncated), a string."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__} "
                         f"{shown(value)}")


def int_in(name: str, value: Any, low: int, high: int) -> int:
    """`integer` within ``[low, high]``. Raises InvalidRequest naming `name`."""
    value = integer(name, value)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be in [{low}, {high}], got {value}")
    return value


def flag(name: str, value: Any) -> bool:
    """`value` if it is True or False. Raises InvalidRequest naming `name`."""
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be True or False, got {shown(value)}")
    return value


def name_of(field: str, value: Any, optional: bool = False) -> str | None:
    """`value` if it is a non-empty string of at most ``MAX_NAME_BYTES`` UTF-8 bytes (or
    None, when `optional`). Raises InvalidRequest naming `field`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty string, got {shown(value)}")
    if utf8_size(field, value) > MAX_NAME_BYTES:
        raise InvalidRequest(f"{field} is over {MAX_NAME_BYTES} bytes")
    return value


def token_list(tokens: Any) -> list[int]:
    """`tokens` as a new list of ints: a list, tuple or range of integers, or an integer
    array (numpy, ``array.array``: through ``.tolist()``). Raises InvalidRequest naming
    ``tokens`` or the offending ``tokens[i]`` (a bool, a float, a string)."""
    if not isinstance(tokens, (list, tuple, range)) and hasattr(tokens, "tolist") and \
            not isinstance(tokens, (str, bytes, Mapping)):
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple, range)):
        raise InvalidRequest(f"tokens must be a list of integer token ids, got "
                             f"{type(tokens).__name__}")
    if len(tokens) == 0:
        raise InvalidRequest("tokens is empty")
    if all(type(t) is int for t in tokens):
        return list(tokens)
    return [integer(f"tokens[{i}]", t) for i, t in enumerate(tokens)]
