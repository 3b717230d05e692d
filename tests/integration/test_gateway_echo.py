"""What ``/v1/completions`` echoes, through the gateway in process (httpx's ASGI transport)
over a real redis-server and a real worker process on the tiny Gemma 3, whose small
vocabulary spells most characters in byte-fallback tokens: the tokens spell the echoed text
at their offsets, a text prompt's BOS is context, ``score_with_bos`` scores token ids after
the BOS they lack without changing the echo, and ``/detokenize`` gives control tokens' text
unless asked to skip them."""

from __future__ import annotations

import pytest

from jobs import PrefillClient
from tests.integration.processes import MODEL, redis_and_worker
from tests.integration.test_gateway import gateway
from tests.jobs.test_gateway_completions import assert_spelled

pytestmark = pytest.mark.anyio

TEXTS = ["a 𓀀𓀁 b ", "Héllo ✓ 日本 🤗\n\n  x", "<bos>Paris"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """A redis-server and one worker process, shared by this module."""
    # One-job steps: a job's floats then do not depend on the jobs that share its step, so the
    # gateway's numbers compare bitwise with a native job's (packed steps agree within the
    # exactness bound: tests/worker/test_packed_steps.py).
    with redis_and_worker(tmp_path_factory.mktemp("gateway-echo"), "gwe1",
                          "--max-batch-jobs", "1") as (server, _):
        yield server.url


@pytest.fixture
def sync(url):
    return PrefillClient.from_url(url)


def scoring(prompt, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
            **fields}


async def test_a_text_prompts_echo_is_its_text_spelled_by_its_tokens(url, sync):
    tokenizer = sync.tokenizer(MODEL)
    async with gateway(url) as http:
        response = await http.post("/v1/completions", json=scoring(TEXTS))
    assert response.status_code == 200, response.text
    for text, c in zip(TEXTS, response.json()["choices"], strict=True):
        assert c["text"] == text
        assert_spelled(c)
        native = sync.result(sync.submit(prompt=text, model=MODEL, top_k=1, prompt_logprobs=1),
                             timeout=60)
        positions = native.prompt_logprobs[1:-1]  # the BOS the tokenizer put first is context
        assert [e["token"] for e in positions] == tokenizer.encode(text, add_bos=False)
        assert c["logprobs"]["token_logprobs"] == [e["logprob"] for e in positions]


async def test_token_ids_echo_their_text_control_tokens_included(url, sync):
    tokenizer = sync.tokenizer(MODEL)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    async with gateway(url) as http:
        response = await http.post("/v1/completions", json=scoring(prompts, max_tokens=1))
    for text, ids, c in zip(TEXTS, prompts, response.json()["choices"], strict=True):
        assert_spelled(c)
        lp = c["logprobs"]
        assert c["text"] == "<bos>" + text + lp["tokens"][-1]
        assert lp["tokens"][0] == "<bos>" and lp["token_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) + 1


async def test_score_with_bos_scores_token_ids_after_the_bos_without_echoing_it(url, sync):
    tokenizer = sync.tokenizer(MODEL)
    ids = tokenizer.encode("a 𓀀 b Paris", add_bos=False)
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # lm-eval's loglikelihood request
    async with gateway(url, score_with_bos=True) as with_bos, gateway(url) as plain:
        scored = (await with_bos.post("/v1/completions", json=body)).json()["choices"][0]
        bare = (await plain.post("/v1/completions", json=body)).json()["choices"][0]
        bos_first = {**body, "prompt": [[tokenizer.bos_id, *ids]]}
        assert ((await with_bos.post("/v1/completions", json=bos_first)).json()["choices"]
                == (await plain.post("/v1/completions", json=bos_first)).json()["choices"])
    native = sync.result(sync.submit(tokens=[tokenizer.bos_id, *ids], model=MODEL, top_k=1,
                                     prompt_logprobs=1), timeout=60)
    lp = scored["logprobs"]
    assert lp["token_logprobs"] == [e["logprob"] for e in native.prompt_logprobs[1:-1]] + [
        native.top_k[0].logprob]
    assert lp["top_logprobs"][0] is not None and bare["logprobs"]["token_logprobs"][0] is None
    # the echo is the client's ids either way (the one token after them may differ)
    assert_spelled(scored)
    assert scored["text"] == "a 𓀀 b Paris" + lp["tokens"][-1]
    assert lp["tokens"][:-1] == bare["logprobs"]["tokens"][:-1]
    assert lp["text_offset"] == bare["logprobs"]["text_offset"]


async def test_detokenize_gives_control_tokens_text_unless_skipped(url, sync):
    tokenizer = sync.tokenizer(MODEL)
    ids = tokenizer.encode("Héllo")
    async with gateway(url) as http:
        full = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
        bare = await http.post("/detokenize", json={"model": MODEL, "tokens": ids,
                                                    "skip_special_tokens": True})
    assert full.json() == {"prompt": "<bos>Héllo"} and bare.json() == {"prompt": "Héllo"}
