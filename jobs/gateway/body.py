"""Request bodies: every route reads its JSON through `json_object` (or `parsed`, for a
pydantic model), so the size limit (`limits.BodyLimit`), the nesting limit and the error
types are one for all. Both run inside the route, after the router's API key dependency, so
the body of a request that lacks the key is never read. No route declares a FastAPI body
parameter: FastAPI reads those before any dependency and words their errors its own way."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..errors import InvalidRequest

# Deepest nesting of arrays and objects a body may have: the gateway's bodies nest three
# deep (a batch of token-id prompts, a list of chat messages), and the bound keeps decoding,
# validating and printing a value far from Python's recursion limit.
MAX_JSON_DEPTH = 64

_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"')
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}

M = TypeVar("M", bound=BaseModel)


def nests_deeper(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the UTF-8 JSON text `body` nests arrays and objects deeper than `max_depth`,
    found without parsing it: escapes are dropped (no quote they hold ends a string), then
    strings, and the brackets left are counted. Text that is not JSON is judged up to where
    a parser would stop, so `json.loads` never recurses deeper than `max_depth` on a body
    this passes."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped.translate(None, _NOT_MARKS)).replace(b'"', b"")
    depth = 0
    for mark in brackets:
        depth += _STEP[mark]
        if depth > max_depth:
            return True
    return False


def decode_json(body: bytes) -> Any:
    """The value of the JSON text `body` (UTF-8, a BOM allowed).

    Raises:
        InvalidRequest: `body` is not UTF-8 JSON, or nests deeper than `MAX_JSON_DEPTH`.
    """
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body is not UTF-8 text: {e}") from e
    if nests_deeper(body):
        raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} arrays and objects")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the body is not JSON: {e}") from e


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, sent as ``application/json``.

    Raises:
        InvalidRequest: another content type, a body `decode_json` refuses, or a value
            that is not an object (400).
        BodyTooLarge: the body passed the app's limit while it was read (413).
    """
    kind = request.headers.get("content-type", "")
    if "json" not in kind:
        raise InvalidRequest("send the body as JSON with 'Content-Type: application/json' "
                             f"(got {kind or 'none'!r})")
    body = decode_json(await request.body())
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def parsed(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the body (`json_object`) validated as `model`. A field it
    refuses is a RequestValidationError, which the app answers 400 naming the field."""

    async def parse(request: Request) -> M:
        body = await json_object(request)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from e

    return parse


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` naming `model` as its JSON body, as FastAPI documents a
    body parameter (`model` holds no nested models, whose schemas would need a home)."""
    schema = model.model_json_schema()
    assert "$defs" not in schema, f"{model.__name__} nests models"
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}
