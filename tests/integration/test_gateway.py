"""The HTTP gateway in process (httpx's ASGI transport) over a real redis-server and a real
worker process on the tiny Gemma 3: every endpoint and every error code, the SSE stream,
OpenAI-style scoring equal to the native job's values, and the tokenizer endpoints equal to
the worker's tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from jobs import AsyncPrefillClient, PrefillClient, keys
from jobs.gateway import create_app
from jobs.serializer import packb
from tests.conftest import RedisServer
from tests.integration.processes import MODEL, ids, redis_and_worker, wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A redis-server and one worker process (4-token chunks), shared by this module."""
    # One-job steps: a job's floats then do not depend on the jobs that share its step, so the
    # gateway's numbers compare bitwise with a native job's (packed steps agree within the
    # exactness bound: tests/worker/test_packed_steps.py).
    with redis_and_worker(tmp_path_factory.mktemp("gateway"), "gw1",
                          "--max-batch-jobs", "1") as stack:
        yield stack


@pytest.fixture(scope="module")
def url(stack):
    return stack[0].url


@pytest.fixture
def sync(url):
    return PrefillClient.from_url(url)


def gateway(url: str, **options) -> httpx.AsyncClient:
    """An HTTP client of a fresh gateway app over `url` (the app's client is closed with
    it)."""
    client_options = {k: options.pop(k) for k in ("max_queue_depth",) if k in options}
    app = create_app(AsyncPrefillClient.from_url(url, **client_options), **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             timeout=120)


@pytest.fixture
async def http(url):
    async with gateway(url) as c:
        yield c


def error_of(response: httpx.Response, status: int) -> str:
    """The ``type`` of a JSON error body, after checking its status and shape."""
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == status and body["message"]
    return body["type"]


# -- native jobs API -------------------------------------------------------------------------

async def test_submit_status_result_equal_the_native_clients(http, sync):
    token_ids = ids(30, 1)
    created = await http.post("/v1/prefill", json={"tokens": token_ids, "model": MODEL,
                                                    "top_k": 5})
    assert created.status_code == 202
    job = created.json()["job_id"]
    assert created.headers["location"] == f"/v1/prefill/{job}"
    assert (await http.get(created.headers["location"])).json()["job_id"] == job
    done = await http.get(f"/v1/prefill/{job}/result", params={"wait": 60})
    assert done.status_code == 200, done.text
    body = done.json()
    native = sync.result(job, timeout=0)
    assert body["top_k"] == [t.__dict__ for t in native.top_k]
    assert (body["state"], body["n_tokens"], body["chunks"]) == ("finished", 30, 8)
    assert (await http.get(f"/v1/prefill/{job}")).json() == sync.status(job).to_dict()
    # a second client's job with the same tokens gets the same logits
    other = sync.submit(tokens=token_ids, model=MODEL, top_k=5)
    assert sync.result(other, timeout=60).top_k == native.top_k


async def test_full_logits_come_back_as_a_list(http, sync):
    created = await http.post("/v1/prefill", json={"tokens": ids(9, 2), "model": MODEL,
                                                    "logits": "full", "top_k": 1})
    job = created.json()["job_id"]
    body = (await http.get(f"/v1/prefill/{job}/result", params={"wait": 60})).json()
    native = sync.result(job, timeout=0)
    assert body["logits"] == pytest.approx(list(native.logits), abs=0, rel=0)
    assert len(body["logits"]) == len(native.logits)


async def test_delete_stops_a_long_job_between_chunks(http, sync, stack):
    created = await http.post("/v1/prefill", json={"tokens": ids(2000, 3), "model": MODEL})
    job = created.json()["job_id"]
    wait_for(lambda: sync.status(job).cursor >= 40, 60, "the job never advanced", stack[1])
    unfinished = await http.get(f"/v1/prefill/{job}/result", params={"wait": 0})
    assert unfinished.status_code == 202 and unfinished.json()["state"] == "prefilling"
    canceled = await http.delete(f"/v1/prefill/{job}")
    assert canceled.status_code == 200 and canceled.json()["changed"] is True
    wait_for(lambda: sync.status(job).state.value == "canceled", 30, "the cancel never landed")
    stopped = sync.status(job)
    assert 40 <= stopped.cursor < 2000 and stopped.cursor % 4 == 0  # at a chunk boundary
    again = await http.delete(f"/v1/prefill/{job}")
    assert again.json() == {"job_id": job, "changed": False, "state": "canceled"}
    result = await http.get(f"/v1/prefill/{job}/result")
    assert error_of(result, 409) == "JobCanceled"
    assert result.json()["job"]["state"] == "canceled"


async def test_events_stream_the_cursor_rising_then_the_terminal_state(http):
    created = await http.post("/v1/prefill", json={"tokens": ids(40, 4), "model": MODEL})
    job = created.json()["job_id"]
    events = []
    async with http.stream("GET", f"/v1/prefill/{job}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in stream.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    names = [n for n, _ in events]
    assert names[-1] == "finished" and set(names[:-1]) == {"status"}
    cursors = [e["cursor"] for _, e in events]
    assert cursors == sorted(cursors) and cursors[-1] == 40
    assert len({c for c in cursors if 0 < c < 40}) >= 2  # progress between the ends
    final = events[-1][1]
    assert (final["progress"], final["n_tokens"], final["state"]) == (1.0, 40, "finished")


async def test_models_lists_the_registered_model(http):
    body = (await http.get("/v1/models")).json()
    assert body["object"] == "list"
    (entry,) = [m for m in body["data"] if m["id"] == MODEL]
    assert entry["object"] == "model" and entry["context_length"] > 0 and entry["vocab_size"]


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, kind", [
    ({"tokens": [2, 3], "model": MODEL, "colour": 1}, 400, "InvalidRequest"),
    ({"tokens": [2, 3], "model": MODEL, "top_k": -1}, 400, "InvalidRequest"),
    ({"model": MODEL}, 400, "InvalidRequest"),
    ({"tokens": [2, 10**9], "model": MODEL}, 400, "TokenOutOfRange"),
    ({"tokens": [2, 3], "model": "nope"}, 404, "UnknownModel"),
    ({"tokens": [2] * 100_000, "model": MODEL}, 413, "PromptTooLong"),
])
async def test_a_bad_submit_is_a_typed_json_error(http, body, status, kind):
    assert error_of(await http.post("/v1/prefill", json=body), status) == kind


async def test_bodies_that_are_not_a_json_object_are_400(http):
    for content in (b"{not json", b"[1, 2]"):
        response = await http.post("/v1/prefill", content=content,
                                   headers={"content-type": "application/json"})
        assert error_of(response, 400) == "InvalidRequest"


async def test_unknown_jobs_are_404_everywhere(http):
    for method, path in (("GET", "/v1/prefill/nope"), ("GET", "/v1/prefill/nope/result"),
                         ("DELETE", "/v1/prefill/nope"), ("GET", "/v1/prefill/nope/events")):
        assert error_of(await http.request(method, path), 404) == "JobNotFound"


async def test_a_body_over_the_limit_is_413_declared_or_streamed(url):
    async with gateway(url, max_body_bytes=1000) as http:
        big = json.dumps({"tokens": [2] * 600, "model": MODEL}).encode()
        headers = {"content-type": "application/json"}
        assert error_of(await http.post("/v1/prefill", content=big, headers=headers),
                        413) == "RequestTooLarge"

        async def chunks():  # no Content-Length: counted as it streams
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        streamed = await http.post("/v1/prefill", content=chunks(), headers=headers)
        assert error_of(streamed, 413) == "RequestTooLarge"
        small = await http.post("/v1/prefill", json={"tokens": [2, 3], "model": MODEL})
        assert small.status_code == 202


async def test_a_full_queue_is_429(url):
    async with gateway(url, max_queue_depth=0) as http:
        response = await http.post("/v1/prefill", json={"tokens": [2, 3], "model": MODEL})
        assert error_of(response, 429) == "QueueFull"


async def test_a_model_without_a_live_worker_is_503(http, url):
    # the registry entry of a worker that has gone: registered, but no heartbeat serves it
    conn = redis.Redis.from_url(url)
    info = {"vocab_size": 512, "context_length": 128, "architecture": "gemma3",
            "sha256": "0" * 64}
    conn.hset(keys.MODELS, "ghost", packb(info))
    try:
        response = await http.post("/v1/prefill", json={"tokens": [2, 3], "model": "ghost"})
        assert error_of(response, 503) == "NoWorker"
        scoring = await http.post("/v1/completions", json={"model": "ghost", "prompt": [2, 3]})
        assert error_of(scoring, 503) == "NoWorker"
    finally:
        conn.hdel(keys.MODELS, "ghost")


async def test_a_model_whose_workers_published_no_tokenizer_is_503_on_tokenize(http, url):
    conn = redis.Redis.from_url(url)  # as an older worker registers: no tokenizer blob
    info = {"vocab_size": 512, "context_length": 128, "architecture": "gemma3",
            "sha256": "1" * 64}
    conn.hset(keys.MODELS, "legacy", packb(info))
    try:
        response = await http.post("/tokenize", json={"model": "legacy", "prompt": "x"})
        assert error_of(response, 503) == "TokenizerUnavailable"
    finally:
        conn.hdel(keys.MODELS, "legacy")


async def test_the_api_key_guards_all_but_health_and_metrics(url):
    async with gateway(url, api_key="s3cret") as http:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/prefill"),
                             ("GET", "/v1/prefill/x"), ("POST", "/v1/completions"),
                             ("POST", "/tokenize"), ("GET", "/tokenizer_info")):
            assert error_of(await http.request(method, path), 401) == "Unauthorized"
            wrong = await http.request(method, path, headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
        assert (await http.get("/v1/models", headers={"authorization": "Bearer s3cret"})
                ).status_code == 200
        assert (await http.get("/health")).status_code in (200, 503)
        assert (await http.get("/metrics")).status_code == 200


# -- OpenAI-compatible scoring ----------------------------------------------------------------

async def test_echo_logprobs_equal_the_native_prompt_logprobs(http, sync):
    token_ids = ids(12, 5)
    body = {"model": MODEL, "prompt": token_ids, "max_tokens": 1, "logprobs": 2,
            "echo": True, "temperature": 0}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    scored = response.json()
    (choice,) = scored["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 13
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    native_job = sync.submit(tokens=token_ids, model=MODEL, top_k=2, prompt_logprobs=2)
    native = sync.result(native_job, timeout=60)
    expected = [e["logprob"] for e in native.prompt_logprobs[:-1]] + [native.top_k[0].logprob]
    assert lp["token_logprobs"] == expected
    tokenizer = sync.tokenizer(MODEL)
    assert lp["tokens"] == tokenizer.pieces(token_ids) + [native.top_k[0].piece]
    for top, entry in zip(lp["top_logprobs"][1:-1], native.prompt_logprobs[1:-1], strict=True):
        assert top == {tokenizer.piece(t["id"]): t["logprob"] for t in reversed(entry["top"])}
        # lm-eval's is_greedy: the token's logprob against the best alternative's
        assert max(top.values()) == entry["top"][0]["logprob"]
    assert lp["text_offset"][0] == 0
    assert choice["text"] == tokenizer.decode(token_ids) + native.top_k[0].piece
    assert scored["usage"] == {"prompt_tokens": 12, "completion_tokens": 1,
                               "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 0}}
    assert scored["object"] == "text_completion" and choice["finish_reason"] == "length"


def lm_eval_loglikelihood(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs``
    (``lm_eval/models/openai_completions.py``) computes from a response: per choice, the
    sum of ``token_logprobs[ctxlen:-1]`` and whether every one equals the best alternative."""
    out = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens,
                              strict=True):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(logprobs), all(lp == max(top.values())
                                       for lp, top in zip(logprobs, tops, strict=True))))
    return out


async def test_lm_evals_loglikelihood_of_a_greedy_and_a_non_greedy_continuation(http, sync):
    context = ids(10, 21)
    greedy = []
    for _ in range(3):  # the greedy continuation, a token at a time through native jobs
        done = sync.result(sync.submit(tokens=context + greedy, model=MODEL, top_k=2),
                           timeout=60)
        greedy.append(done.top_k[0].id)
    runner_up = done.top_k[1].id  # the second best last token
    body = {"model": MODEL, "prompt": [context + greedy, context + greedy[:2] + [runner_up]],
            "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (greedy_lp, greedy_is), (other_lp, other_is) = lm_eval_loglikelihood(
        response.json(), [len(context)] * 2)
    assert greedy_is is True and other_is is False
    native = sync.result(sync.submit(tokens=context + greedy, model=MODEL, top_k=1,
                                     prompt_logprobs=1), timeout=60)
    expected = sum(e["logprob"] for e in native.prompt_logprobs[len(context):-1])
    assert greedy_lp == expected and other_lp < greedy_lp


async def test_a_batch_is_one_job_per_prompt_in_order(http, sync):
    prompts = [ids(6, 6), ids(9, 7), ids(5, 8)]
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1})
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, c in zip(prompts, choices, strict=True):
        native = sync.result(sync.submit(tokens=prompt, model=MODEL, top_k=1), timeout=60)
        assert c["text"] == native.top_k[0].piece  # not echoed: the one token only
        assert c["logprobs"]["token_logprobs"] == [native.top_k[0].logprob]
        assert c["logprobs"]["tokens"] == [native.top_k[0].piece]


async def test_text_prompts_and_max_tokens_zero(http, sync):
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": ["The capital of", "Hello"], "max_tokens": 0,
        "echo": True})
    body = response.json()
    assert [c["text"] for c in body["choices"]] == ["The capital of", "Hello"]
    assert [c["logprobs"] for c in body["choices"]] == [None, None]
    tokenizer = sync.tokenizer(MODEL)
    n = sum(len(tokenizer.encode(p)) for p in ("The capital of", "Hello"))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("extra, fragment", [
    ({"max_tokens": 2}, "max_tokens must be 0 or 1"),
    ({"temperature": 0.7}, "temperature must be 0"),
    ({"n": 2}, "n and best_of"),
    ({"stream": True}, "stream"),
    ({"logprobs": -1}, "logprobs"),
    ({"max_tokens": "1"}, "max_tokens"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [[2, 3], "text"]}, "prompt"),
])
async def test_what_a_prefill_cannot_answer_is_400(http, extra, fragment):
    body = {"model": MODEL, "prompt": [2, 3], **extra}
    response = await http.post("/v1/completions", json=body)
    assert error_of(response, 400) == "InvalidRequest"
    assert fragment in response.json()["error"]["message"]


async def test_a_failed_scoring_job_is_its_input_error(http):
    too_long = "word " * 5000  # tokenized by the worker, over the tiny model's context
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": too_long})
    assert error_of(response, 413) == "PromptTooLong"


# -- tokenizer endpoints ---------------------------------------------------------------------

async def test_tokenize_and_detokenize_match_the_workers_tokenizer(http, tiny):
    text = "The capital of France is <start_of_turn>Paris\n\n"
    body = (await http.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
    assert body["tokens"] == tiny.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == tiny.context_length
    bare = (await http.post("/tokenize", json={"model": MODEL, "prompt": text,
                                               "add_special_tokens": False})).json()
    assert bare["tokens"] == tiny.tokenizer.encode(text, add_bos=False)
    back = (await http.post("/detokenize", json={"model": MODEL, "tokens": bare["tokens"]}))
    assert back.json() == {"prompt": tiny.tokenizer.decode(bare["tokens"])}
    bad = await http.post("/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert error_of(bad, 400) == "TokenOutOfRange"
    assert error_of(await http.post("/tokenize", json={"model": "nope", "prompt": "x"}),
                    404) == "UnknownModel"


async def test_lm_evals_remote_tokenizer_check_passes(http, tiny):
    # what lm_eval.utils.check_remote_tokenizer_support asks, in order
    info = (await http.get("/tokenizer_info", params={"model": MODEL})).json()
    assert info["model"] == MODEL
    # lm-eval's eos_token_id is encode(eos_token)[0]
    eos = await http.post("/tokenize", json={"model": MODEL, "prompt": info["eos_token"],
                                             "add_special_tokens": False})
    assert eos.json()["tokens"] == [tiny.tokenizer.eos_id]
    probe = await http.post("/tokenize", json={"model": MODEL, "prompt": "test",
                                               "add_special_tokens": False})
    assert isinstance(probe.json()["tokens"], list) and probe.json()["tokens"]


# -- health and metrics ----------------------------------------------------------------------

def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_health_counts_the_live_worker(http):
    response = await http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["redis"] is True and body["workers"] >= 1
    assert body["models"][MODEL] == {"live_workers": 1}


async def test_health_is_503_without_workers_or_without_redis(url):
    async with gateway(url.rsplit("/", 1)[0] + "/9") as empty:  # a database no worker uses
        response = await empty.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "no live worker"
    dead = RedisServer().start()
    dead_url = dead.url
    dead.stop()
    async with gateway(dead_url) as unreachable:
        response = await unreachable.get("/health")
        assert response.status_code == 503 and response.json()["redis"] is False


async def test_metrics_count_a_job_its_tokens_and_chunks(http, sync):
    before = samples((await http.get("/metrics")).text)
    busy = [before[("prefillq_jobs_current", (("state", s),))] for s in ("queued", "prefilling")]
    assert busy == [0, 0], "another test's job is still running"
    job = sync.submit(tokens=ids(30, 9), model=MODEL, top_k=1)
    sync.result(job, timeout=60)
    response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = samples(response.text)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert delta("prefillq_jobs_total", state="submitted") == 1
    assert delta("prefillq_jobs_total", state="finished") == 1
    assert delta("prefillq_jobs_total", state="failed") == 0
    assert delta("prefillq_tokens_prefilled_total") == 30
    assert delta("prefillq_tokens_reused_total") == 0
    # this worker keeps no prefix cache (tests/worker/test_prefix_cache.py counts them)
    assert delta("prefillq_prefix_cache_hits_total") == 0
    assert delta("prefillq_prefix_cache_misses_total") == 0
    assert after[("prefillq_prefix_cache_bytes", ())] == 0
    assert delta("prefillq_chunk_seconds_count") == 8  # 30 tokens in 4-token chunks
    assert delta("prefillq_chunk_seconds_bucket", le="+Inf") == 8
    assert delta("prefillq_chunk_seconds_sum") > 0
    assert after[("prefillq_live_workers", (("model", MODEL),))] == 1
    assert after[("prefillq_queue_depth", (("model", MODEL),))] == 0


async def test_metrics_count_a_tenants_tokens_and_service(http, sync):
    job = sync.submit(tokens=ids(30, 10), model=MODEL, top_k=1, tenant="acme")
    sync.result(job, timeout=60)
    after = samples((await http.get("/metrics")).text)
    acme = (("tenant", "acme"),)
    assert after[("prefillq_tenant_tokens_prefilled_total", acme)] == 30
    assert after[("prefillq_tenant_service", acme)] >= 30  # weight 1, and its lift
    assert after[("prefillq_tenant_queued", acme)] == 0
    assert after[("prefillq_tenant_prefilling", acme)] == 0
    assert after[("prefillq_tenant_service_spread", ())] == 0


def test_the_gateway_never_imports_mlx():
    import subprocess
    import sys

    probe = ("import sys, jobs.gateway.app, jobs.gateway.serve; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'model')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("path", ["/v1/prefill", "/v1/completions", "/tokenize"])
async def test_a_body_without_the_json_content_type_is_told_so(http, path):
    response = await http.post(path, content=b'{"prompt": "x"}',  # what curl -d sends
                               headers={"content-type": "application/x-www-form-urlencoded"})
    assert error_of(response, 400) == "InvalidRequest"
    assert "Content-Type: application/json" in response.json()["error"]["message"]


async def test_unknown_routes_and_methods_answer_in_the_error_shape(http):
    assert error_of(await http.get("/v2/nothing"), 404) == "NotFound"
    assert error_of(await http.put("/v1/prefill"), 405) == "MethodNotAllowed"


async def test_an_idempotent_resubmit_answers_its_jobs_state(http, sync):
    body = {"tokens": ids(6, 31), "model": MODEL, "idempotency_key": "gw-idem-1"}
    first = (await http.post("/v1/prefill", json=body)).json()
    sync.result(first["job_id"], timeout=60)
    again = await http.post("/v1/prefill", json=body)
    assert again.json() == {"job_id": first["job_id"], "state": "finished"}


async def test_an_unreachable_redis_is_503_not_a_crash():
    gone = RedisServer().start()
    gone_url = gone.url
    gone.stop()
    async with gateway(gone_url) as http:
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/prefill", {"tokens": [2, 3]}),
                                   ("GET", "/v1/prefill/x", None)):
            response = await http.request(method, path, json=body)
            assert error_of(response, 503) == "ConnectionError", path
