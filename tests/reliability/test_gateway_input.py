"""Bad input and junk records through the HTTP gateway's native endpoints (in process, over a
real redis-server): every one is a JSON error of the documented status and type that names
the field, never a 500 or a traceback."""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from jobs import AsyncPrefillClient, PrefillClient, keys
from jobs.gateway import create_app
from jobs.record import JobRecord

from .helpers import MODEL

pytestmark = pytest.mark.anyio


@pytest.fixture
async def http(redis_server):
    redis.Redis.from_url(redis_server).flushall()
    app = create_app(AsyncPrefillClient.from_url(redis_server))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw", timeout=60) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> tuple[str, str]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == status
    return body["type"], body["message"]


@pytest.mark.parametrize("body, message", [
    ({"tokens": ["a"]}, "tokens[0] must be an integer, got str 'a'"),
    ({"tokens": {"a": 1}}, "tokens must be a list of integer token ids, got dict"),
    ({"tokens": [2, 1.5]}, "tokens[1] must be an integer, got float 1.5"),
    ({"tokens": [2, True]}, "tokens[1] must be an integer, got bool True"),
    ({"prompt": "\ud800abc"}, "prompt is not valid text: '\\ud800' at index 0"),
    ({"messages": [{"role": "user", "content": "\udc80"}]}, "messages[0].content is not valid"),
    ({"prompt": "x", "top_k": "x"}, "top_k must be an integer, got str 'x'"),
    ({"prompt": "x", "top_k": 2.5}, "top_k must be an integer, got float 2.5"),
    ({"prompt": "x", "chunk_tokens": "big"}, "chunk_tokens must be an integer, got str"),
    ({"prompt": "x", "priority": "high"}, "priority must be an integer, got str 'high'"),
    ({"prompt": "x", "max_attempts": None}, "max_attempts must be an integer, got NoneType"),
    ({"prompt": "x", "model": ["m"]}, "model must be a non-empty string, got ['m']"),
    ({"prompt": "x", "session": 5}, "session must be a non-empty string, got 5"),
    ({"prompt": "x", "idempotency_key": ""}, "idempotency_key must be a non-empty string"),
    ({"prompt": "x", "parse_special": "no"}, "parse_special must be True or False, got 'no'"),
    ({"prompt": 5}, "prompt must be a string, got int"),
    ({"prompt": "x", "tokens": [2]}, "give exactly one of prompt, tokens or messages, got "
                                     "prompt and tokens"),
])
async def test_a_bad_field_is_a_400_naming_it(http, body, message):
    # json.dumps escapes a lone surrogate as "\ud800", as a curl user would send it
    response = await http.post("/v1/prefill", content=json.dumps({"model": MODEL, **body}),
                               headers={"content-type": "application/json"})
    kind, said = error_of(response, 400)
    assert kind == "InvalidRequest" and said.startswith(message), said


async def test_a_10_mb_prompt_is_a_413(http):
    response = await http.post("/v1/prefill", json={"model": MODEL, "prompt": "x" * 10**7})
    kind, message = error_of(response, 413)
    assert kind == "PromptTooLarge" and "more than the limit of 8388608" in message


async def test_unknown_ids_are_404s(http):
    for method, path in (("GET", "/v1/prefill/nope"), ("GET", "/v1/prefill/nope/result"),
                         ("DELETE", "/v1/prefill/nope"), ("GET", "/v1/prefill/nope/events")):
        response = await http.request(method, path)
        assert error_of(response, 404)[0] == "JobNotFound"


async def test_a_record_that_does_not_decode_is_a_502_corrupt_job(http, redis_server):
    r = redis.Redis.from_url(redis_server)
    r.hset(keys.job("junk"), mapping={**JobRecord("junk", MODEL, prompt="x").to_hash(),
                                      "tokens": b"\xc1", "cursor": "ten"})
    for method, path in (("GET", "/v1/prefill/junk"), ("GET", "/v1/prefill/junk/result"),
                         ("GET", "/v1/prefill/junk/events")):
        kind, message = error_of(await http.request(method, path), 502)
        assert kind == "CorruptJob" and "cursor" in message and "tokens" in message
    # a worker would fail it and drop the bad fields; then its status reads again
    r.hdel(keys.job("junk"), "tokens", "cursor")
    assert (await http.get("/v1/prefill/junk")).json()["state"] == "queued"
    assert PrefillClient(r).status("junk").state == "queued"
