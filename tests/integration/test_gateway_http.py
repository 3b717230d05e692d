"""The gateway's request handling as an HTTP client meets it: ``prefillq serve --api-key``
as a real uvicorn process over a real redis-server. Every body route answers an oversized
body 413 however it is sent, malformed or deeply nested JSON a typed 400, and a request
without the key 401 before its body is read; ``/v1/models`` lists what a live worker
serves, so a client that waits for its model there is accepted at once."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from fastapi.routing import APIRoute

from jobs import AsyncPrefillClient, keys
from jobs.gateway import create_app
from jobs.serializer import packb
from tests.conftest import RedisServer
from tests.integration.processes import MODEL, GatewayProcess, WorkerProcess, wait_for
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


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": "hi", "model": "\ud800"}),
    ("/detokenize", {"tokens": [2], "model": "\ud800"}),
])
def test_a_lone_surrogate_in_a_model_name_is_a_typed_400(stack, path, body):
    r = post(stack[1], path, json.dumps(body).encode())  # json writes the lone \ud800 escaped
    assert error_of(r, 400) == "InvalidRequest"  # it was a 500 UnicodeEncodeError


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


def listed(gateway: GatewayProcess) -> list[str]:
    response = httpx.get(gateway.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def live_in_health(gateway: GatewayProcess) -> list[str]:
    models = httpx.get(gateway.url + "/health").json()["models"]
    return [m for m, n in models.items() if n["live_workers"] > 0]


@pytest.mark.parametrize("probe", [listed, live_in_health], ids=["models", "health"])
def test_a_model_is_listed_and_taken_once_a_live_worker_serves_it(stack, tmp_path, probe):
    server, gateway = stack
    conn = redis.Redis.from_url(server.url)
    # what a worker writes first, and leaves behind when it dies: registered, no heartbeat
    conn.hset(keys.MODELS, MODEL, packb({"vocab_size": 365, "context_length": 128,
                                         "architecture": "gemma3", "sha256": "0" * 64}))
    assert listed(gateway) == [] and live_in_health(gateway) == []
    name = f"gwh-{probe.__name__}"
    started: list[WorkerProcess] = []
    starting = threading.Thread(target=lambda: started.append(
        WorkerProcess(server.url, name, tmp_path)))
    starting.start()
    try:
        # a client waiting for its model, as scripts and lm-eval setups do: once `probe`
        # shows it, a submit is taken (before, it may fail with NoWorker)
        while True:
            up = not starting.is_alive()  # its heartbeat exists (or it failed to start)
            ready = MODEL in probe(gateway)
            submitted = post(gateway, "/v1/prefill", json.dumps({"model": MODEL,
                                                                  "tokens": [2, 3]}))
            if ready:
                assert submitted.status_code == 202, submitted.text
                break
            if submitted.status_code != 202:  # 202: the worker came up in between
                assert error_of(submitted, 503) == "NoWorker"
            assert not up, f"the worker is up, its model not shown: {tmp_path / name}.log"
            time.sleep(0.05)
        assert listed(gateway) == live_in_health(gateway) == [MODEL]
        starting.join()
        started[0].stop()  # killed: its heartbeat expires, its registration stays
        wait_for(lambda: listed(gateway) == [], 30, "a dead worker's model is still listed")
        assert live_in_health(gateway) == [] and conn.hexists(keys.MODELS, MODEL)
    finally:
        starting.join()
        for worker in started:
            worker.stop()
