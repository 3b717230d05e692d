"""`prefillq serve` as a real uvicorn process, with a real worker process and redis-server:
the `openai` Python client's scoring call, a disconnect canceling its job, and the SSE
stream arriving while the job runs."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from jobs import PrefillClient, keys
from tests.conftest import RedisServer
from tests.integration.processes import MODEL, GatewayProcess, WorkerProcess, ids, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-server")
    server = RedisServer(tmp).start()
    worker = WorkerProcess(server.url, "gws1", tmp)
    gateway = GatewayProcess(server.url, tmp, "--api-key", "k3y",
                             "--tenant-key", "acme-k3y=acme")
    yield server, worker, gateway
    gateway.stop()
    worker.stop()
    server.stop()


def test_the_openai_client_scores_a_prompt_as_the_native_job_does(stack):
    server, _, gateway = stack
    token_ids = ids(10, 11)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k3y")
    completion = client.completions.create(model=MODEL, prompt=[token_ids], max_tokens=1,
                                           logprobs=1, echo=True, temperature=0)
    lp = completion.choices[0].logprobs
    assert len(lp.token_logprobs) == len(token_ids) + 1 and lp.token_logprobs[0] is None
    native_client = PrefillClient.from_url(server.url)
    native = native_client.result(native_client.submit(
        tokens=token_ids, model=MODEL, top_k=1, prompt_logprobs=1), timeout=60)
    assert lp.token_logprobs == ([e["logprob"] for e in native.prompt_logprobs[:-1]]
                                 + [native.top_k[0].logprob])
    assert completion.usage.prompt_tokens == len(token_ids)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong").completions.create(
            model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be 0 or 1"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5)


def test_a_tenants_api_key_makes_its_requests_jobs_that_tenants(stack):
    server, _, gateway = stack
    conn = redis.Redis.from_url(server.url)

    def prefill(key: str, **body) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/prefill", headers={"Authorization": f"Bearer {key}"},
                          json={"tokens": ids(8, 12), "model": MODEL, **body}, timeout=30)

    keyed = prefill("acme-k3y")
    assert keyed.status_code == 202
    assert conn.hget(keys.job(keyed.json()["job_id"]), "tenant") == b"acme"
    named = prefill("k3y", tenant="zeta")  # the plain key: the body names the tenant
    assert conn.hget(keys.job(named.json()["job_id"]), "tenant") == b"zeta"
    other = prefill("acme-k3y", tenant="zeta")
    assert other.status_code == 400 and "this API key's tenant is 'acme'" in other.text
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="acme-k3y")
    completion = client.completions.create(model=MODEL, prompt=[ids(6, 13)], max_tokens=1,
                                           temperature=0)
    assert completion.choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="may not name another"):
        client.completions.create(model=MODEL, prompt=[ids(6, 13)], max_tokens=1,
                                  temperature=0, extra_body={"tenant": "zeta"})
    assert prefill("nope").status_code == 401


def jobs_in(conn) -> list[str]:
    return [k.decode().split("{")[1].split("}")[0] for k in conn.scan_iter("prefillq:{*}:job")]


def test_a_disconnected_scoring_request_cancels_its_job(stack):
    server, worker, gateway = stack
    conn = redis.Redis.from_url(server.url)
    before = set(jobs_in(conn))
    body = {"model": MODEL, "prompt": ids(4000, 12), "max_tokens": 1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=1.5,
                   headers={"authorization": "Bearer k3y"})
    (job,) = set(jobs_in(conn)) - before
    client = PrefillClient.from_url(server.url)
    try:
        wait_for(lambda: client.status(job).state.value == "canceled", 30,
                 "the disconnect did not cancel the job", worker)
    except pytest.fail.Exception:
        status = client.status(job)
        pytest.fail(f"the disconnect did not cancel the job: {status.state.value} at "
                    f"cursor {status.cursor}\n{gateway.log_path.read_text()[-3000:]}")
    assert 0 < client.status(job).cursor < 4000


def test_events_arrive_while_the_job_runs(stack):
    server, _, gateway = stack
    headers = {"authorization": "Bearer k3y"}
    job = httpx.post(gateway.url + "/v1/prefill", headers=headers,
                     json={"tokens": ids(400, 13), "model": MODEL}).json()["job_id"]
    seen: list[tuple[float, dict]] = []
    with httpx.stream("GET", f"{gateway.url}/v1/prefill/{job}/events", headers=headers,
                      timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                seen.append((time.time(), json.loads(line[len("data: "):])))
    finished = seen[-1][1]
    assert finished["state"] == "finished"
    running = [at for at, s in seen if s["state"] == "prefilling" and 0 < s["cursor"] < 400]
    assert len(running) >= 5
    assert running[0] < finished["finished_at"]  # streamed while it ran, not at the end
