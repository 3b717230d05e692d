"""The gateway's request handling as an HTTP client meets it: ``prefillq serve --api-key``
as a real uvicorn process over a real redis-server. Every body route answers an oversized
body 413 however it is sent, malformed or deeply nested JSON a typed 400, and a request
without the key 401 before its body is read."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.routing import APIRoute

from jobs import AsyncPrefillClient
from jobs.gateway import create_app
from tests.conftest import RedisServer
from tests.integration.processes import MODEL, GatewayProcess
from tests.integration.test_gateway import error_of

KEY = "k3y"
# Small enough to pass quickly, large enough for the nested bodies below.
MAX_BODY_BYTES = 256 * 1024
BODY_ROUTES = ("/v1/prefill", "/v1/completions", "/tokenize", "/detokenize")
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A redis-server and a gateway process with an API key (no worker)."""
    tmp = tmp_path_factory.mktemp("gateway-http")
    server = RedisServer(tmp).start()
    gateway = GatewayProcess(server.url, tmp, "--api-key", KEY,
                             "--max-body-bytes", str(MAX_BODY_BYTES))
    yield server, gateway
    gateway.stop()
    server.stop()


def post(gateway: GatewayProcess, path: str, content, key: str | None = KEY) -> httpx.Response:
    headers = dict(JSON) if key is None else {**JSON, "authorization": f"Bearer {key}"}
    return httpx.post(gateway.url + path, content=content, headers=headers, timeout=30)


def chunks(body: bytes, size: int = 4096):
    """`body` as a generator, so httpx sends it chunked, with no Content-Length."""
    for i in range(0, len(body), size):
        yield body[i:i + size]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_body_over_the_limit_is_413_declared_or_chunked(stack, path):
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    declared = post(stack[1], path, big)
    assert error_of(declared, 413) == "RequestTooLarge"
    streamed = post(stack[1], path, chunks(big))
    assert "content-length" not in streamed.request.headers
    assert error_of(streamed, 413) == "RequestTooLarge"


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 30_000,
                                  b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}"],
                         ids=["100k-arrays", "30k-objects", "100-levels"])
@pytest.mark.parametrize("path", BODY_ROUTES)
def test_deeply_nested_json_is_a_typed_400(stack, path, body):
    response = post(stack[1], path, body)
    assert error_of(response, 400) == "InvalidRequest"
    assert "nests deeper than" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_malformed_json_is_a_typed_400(stack, path):
    response = post(stack[1], path, b'{"prompt": ')
    assert error_of(response, 400) == "InvalidRequest"
    assert response.json()["error"]["message"].startswith("the body is not JSON")


def first_response_line(gateway: GatewayProcess, path: str, start: bytes) -> bytes:
    """The status line the gateway answers to a chunked POST of which only `start` is sent
    (the rest never comes), or what the socket holds after 10 s."""
    where = urlsplit(gateway.url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                  f"{len(start):x}\r\n".encode() + start + b"\r\n")
        try:
            return s.recv(4096).split(b"\r\n", 1)[0]
        except TimeoutError:
            return b"no answer while the body was unfinished"


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_without_the_key_a_body_is_401_before_it_is_read(stack, path):
    assert error_of(post(stack[1], path, b"{not json", key=None), 401) == "Unauthorized"
    assert error_of(post(stack[1], path, b"{not json", key="wrong"), 401) == "Unauthorized"
    assert first_response_line(stack[1], path, b'{"prompt": "') == b"HTTP/1.1 401 Unauthorized"


def test_no_route_has_fastapi_read_its_body():
    # FastAPI reads a body parameter before any dependency, the API key's included
    from jobs.gateway.app import ROUTERS

    routes = [r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]
    assert routes and [r.path for r in routes if r.body_field is not None] == []
    app = create_app(AsyncPrefillClient.from_url("redis://127.0.0.1:1"))
    documented = app.openapi()["paths"]
    for path in BODY_ROUTES[1:]:  # their models' schemas, as a body parameter's would be
        assert documented[path]["post"]["requestBody"]["content"]["application/json"]
