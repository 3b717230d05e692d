"""``POST /v1/score`` (SGLang's decoder-only scoring request): each label token's probability
after query + item equals what a cold prefill of query + item gives, within the exactness
bound, with the query prefilled once (one job, the items its continuations) or, with
``item_first``, a job per item. Through the gateway in process (httpx's ASGI transport) over
a real redis-server and a real worker process on the tiny Gemma 3."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jobs import keys
from jobs.aio import AsyncPrefillClient
from model.logprobs import logprobs_of
from model.registry import load_model
from tests.integration.processes import MODEL, redis_and_worker
from tests.integration.test_gateway import error_of, gateway

pytestmark = pytest.mark.anyio

BOUND = 5e-6  # continuation against cold (tests/model/test_continuations.py)
LABELS = [300, 301, 302]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with redis_and_worker(tmp_path_factory.mktemp("gateway-score"), "gsc1") as (server, _):
        yield server.url


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _expected(tiny, prompt: list[int], apply_softmax: bool) -> tuple[list[float], float]:
    """The labels' probabilities after a cold prefill of `prompt`, and the largest |logprob|."""
    logprobs = logprobs_of(tiny.start_prefill(prompt).run(), LABELS)
    if apply_softmax:
        z = math.log(math.fsum(math.exp(lp) for lp in logprobs))
        return [math.exp(lp - z) for lp in logprobs], max(map(abs, logprobs))
    return [math.exp(lp) for lp in logprobs], max(map(abs, logprobs))


def _check(scores, prompts, tiny, apply_softmax: bool) -> None:
    assert len(scores) == len(prompts)
    for got, prompt in zip(scores, prompts, strict=True):
        want, scale = _expected(tiny, prompt, apply_softmax)
        assert np.allclose(got, want, rtol=0, atol=BOUND * scale)
        if apply_softmax:
            assert math.fsum(got) == pytest.approx(1.0)


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
async def test_label_probabilities_after_query_and_item_equal_a_cold_prefills(
        url, tiny, item_first, apply_softmax):
    rng = np.random.default_rng(3)
    query = [2, *rng.integers(260, 365, 39).tolist()]
    items = [rng.integers(260, 365, m).tolist() for m in (1, 6, 20)]
    async with gateway(url) as http:
        response = await http.post("/v1/score", json={
            "model": MODEL, "query": query, "items": items, "label_token_ids": LABELS,
            "apply_softmax": apply_softmax, "item_first": item_first})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "scoring" and body["model"] == MODEL
    prompts = [item + query if item_first else query + item for item in items]
    assert body["usage"]["prompt_tokens"] == (sum(len(p) for p in prompts) if item_first else
                                              len(query) + sum(len(i) for i in items))
    _check(body["scores"], prompts, tiny, apply_softmax)


async def test_text_items_are_scored_after_the_query_as_continuations(url, tiny):
    query = "Is the sky blue? Answer:"
    items = [" yes", " no it is not"]
    client = AsyncPrefillClient.from_url(url)
    before = set(await client.redis.keys(keys.job("*")))
    async with gateway(url) as http:
        response = await http.post("/v1/score", json={
            "model": MODEL, "query": query, "items": items, "label_token_ids": LABELS})
    assert response.status_code == 200, response.text
    assert len(set(await client.redis.keys(keys.job("*"))) - before) == 1  # one job
    await client.aclose()
    context = tiny.tokenizer.encode(query)
    prompts = [context + tiny.tokenizer.encode(query + i)[len(context):] for i in items]
    _check(response.json()["scores"], prompts, tiny, True)


async def test_bad_score_requests_are_refused(url):
    body = {"model": MODEL, "query": [2, 300], "items": [[301]], "label_token_ids": LABELS}
    async with gateway(url) as http:
        mixed = await http.post("/v1/score", json={**body, "query": "text"})
        no_labels = await http.post("/v1/score", json={**body, "label_token_ids": []})
        no_items = await http.post("/v1/score", json={**body, "items": []})
        out_of_vocab = await http.post("/v1/score", json={**body, "label_token_ids": [10**6]})
    assert error_of(mixed, 400) == "InvalidRequest"
    assert error_of(no_labels, 400) == "InvalidRequest"
    assert error_of(no_items, 400) == "InvalidRequest"
    assert error_of(out_of_vocab, 400) == "TokenOutOfRange"
