"""``/v1/completions`` batches whose token-id prompts share a prefix (`jobs.gateway.shared`):
the prefix is prefilled once (one job, the prompts' rests its continuations), and each
prompt's answer is what it gets alone, within the exactness bound: the same tokens, the same
top alternatives and generated token, logprobs within 5e-6 of the largest; the usage counts
the shared prefix as cached. Through the gateway in process (httpx's ASGI transport) over a
real redis-server and a real worker process on the tiny Gemma 3."""

from __future__ import annotations

import numpy as np
import pytest

from jobs import PrefillClient, keys
from jobs.gateway.shared import MIN_SHARED_TOKENS
from tests.integration.processes import MODEL, redis_and_worker
from tests.integration.test_gateway import gateway

pytestmark = pytest.mark.anyio

# continuation against cold (tests/model/test_continuations.py: measured up to 4.6e-7)
BOUND = 5e-6


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with redis_and_worker(tmp_path_factory.mktemp("gateway-shared"), "gws1") as (server, _):
        yield server.url


def _ids(rng, n: int) -> list[int]:
    return rng.integers(260, 365, size=n).tolist()


def _batch() -> tuple[list[list[int]], int]:
    """Two questions of three choices each on 40- and 50-token contexts, and one prompt
    alone; and the prompt tokens a shared prefix saves."""
    rng = np.random.default_rng(1)
    first, second = [2, *_ids(rng, 39)], [2, *_ids(rng, 49)]
    prompts = [first + _ids(rng, m) for m in (1, 3, 7)]
    prompts += [second + _ids(rng, m) for m in (2, 2, 5)]
    prompts.append([2, *_ids(rng, 60)])
    return prompts, 2 * 40 + 2 * 50


def _request(prompts, max_tokens: int) -> dict:  # lm-eval's loglikelihood request
    return {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 2,
            "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_prompts_sharing_a_prefix_are_answered_as_alone(url, max_tokens):
    prompts, shared = _batch()
    assert min(len(p) for p in prompts) > MIN_SHARED_TOKENS
    async with gateway(url) as http:
        together = await http.post("/v1/completions", json=_request(prompts, max_tokens))
        alone = [await http.post("/v1/completions", json=_request([p], max_tokens))
                 for p in prompts]
    assert together.status_code == 200, together.text
    body = together.json()
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    for ours, theirs in zip(body["choices"], (a.json()["choices"][0] for a in alone),
                            strict=True):
        mine, ref = ours["logprobs"], theirs["logprobs"]
        assert ours["text"] == theirs["text"]
        assert mine["tokens"] == ref["tokens"] and mine["text_offset"] == ref["text_offset"]
        assert mine["token_logprobs"][0] is None and ref["token_logprobs"][0] is None
        got, want = np.array(mine["token_logprobs"][1:]), np.array(ref["token_logprobs"][1:])
        scale = float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= BOUND * scale
        for top, top_ref in zip(mine["top_logprobs"][1:], ref["top_logprobs"][1:], strict=True):
            assert list(top) == list(top_ref)
            assert np.allclose(list(top.values()), list(top_ref.values()), atol=BOUND * scale)


async def test_a_batch_of_shared_prompts_is_one_job_per_question(url):
    prompts, _ = _batch()
    client = PrefillClient.from_url(url)
    before = set(client.redis.keys(keys.job("*")))
    async with gateway(url) as http:
        response = await http.post("/v1/completions", json=_request(prompts, 1))
    assert response.status_code == 200, response.text
    jobs = set(client.redis.keys(keys.job("*"))) - before
    assert len(jobs) == 3  # two questions and the lone prompt, not seven prompts
    shared = [j for j in jobs if client.redis.hget(j, "continuations") is not None]
    assert len(shared) == 2
