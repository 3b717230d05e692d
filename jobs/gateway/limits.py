"""Request-body limit, as pure ASGI middleware: a body over `max_bytes` is answered 413
``RequestTooLarge`` before it is read into memory, whether it declares a ``Content-Length``
or streams chunks (then `BodyTooLarge` is raised from the read, and the app's handler
answers)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..defaults import DEFAULT_MAX_BODY_BYTES
from .errors import error_body


class BodyTooLarge(Exception):
    """A streamed request body passed the limit (bytes) while it was read."""

    def __init__(self, max_bytes: int):
        super().__init__(f"the request body is over {max_bytes} bytes")


class BodyLimit:
    """ASGI middleware refusing request bodies over `max_bytes` (bytes)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await refuse(send, BodyTooLarge(self.max_bytes))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


async def refuse(send: Send, error: BodyTooLarge) -> None:
    body = json.dumps(error_body(413, "RequestTooLarge", str(error))).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
