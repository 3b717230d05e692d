"""Redis URLs with a password, an ACL user and TLS work for every part of prefillq: a job
runs end to end over each kind of URL through the sync and asyncio clients, a worker
process (``prefillq worker --redis URL``, its KV checkpoints over the same URL) and a
gateway process (``prefillq serve --redis URL``).

The TLS server's certificate is signed by a throwaway CA made with ``openssl``; clients
trust it with ``rediss://...?ssl_ca_certs=ca.pem`` and nothing else, and without it the
connection is refused.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import redis

from jobs import AsyncPrefillClient, PrefillClient
from tests.integration.processes import (
    MODEL,
    GatewayProcess,
    WorkerProcess,
    expected_top,
    ids,
)
from worker.redis_server import RedisServer

from .certs import make_tls_files

PASSWORD = "s3cret-default"
USER, USER_PASSWORD = "alice", "al1ce:p@ss/w0rd"  # URL-special characters, quoted in URLs


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A plain server and a TLS-only one, each with a default password and an ACL user."""
    tmp = tmp_path_factory.mktemp("auth")
    tls = make_tls_files(tmp / "certs")
    plain = RedisServer(tmp / "plain", password=PASSWORD, users={USER: USER_PASSWORD})
    secure = RedisServer(tmp / "tls", password=PASSWORD, users={USER: USER_PASSWORD},
                         tls=tls)
    for server, where in ((plain, "plain"), (secure, "tls")):
        (tmp / where).mkdir()
        server.start()
    yield {"password": plain.url, "acl": plain.url_as(USER, USER_PASSWORD),
           "tls": secure.url_as(USER, USER_PASSWORD), "tls-password": secure.url,
           "servers": (plain, secure)}
    for server in (plain, secure):
        server.stop()


def test_the_urls_authenticate_as_they_say(servers):
    for kind in ("password", "acl", "tls", "tls-password"):
        conn = redis.Redis.from_url(servers[kind], decode_responses=True)
        assert conn.acl_whoami() == ("alice" if kind in ("acl", "tls") else "default")
    plain, secure = servers["servers"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(plain.url_as(None, None)).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(plain.url_as(USER, "wrong")).ping()
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis.from_url(secure.url.split("?")[0]).ping()  # the CA not trusted
    assert servers["tls"].startswith("rediss://")


@pytest.mark.parametrize("kind", ["password", "acl", "tls"])
def test_a_job_runs_end_to_end_over_the_url(servers, kind, tmp_path, tiny):
    url = servers[kind]
    name = f"auth-{kind}"
    worker = WorkerProcess(url, name, tmp_path, "--checkpoint-store", url,
                           "--checkpoint-every", "1")
    gateway = GatewayProcess(url, tmp_path, name=f"gateway-{kind}")
    try:
        token_ids = ids(40, 21)
        top, _ = expected_top(tiny, token_ids, 3)

        sync = PrefillClient.from_url(url)
        job = sync.submit(tokens=token_ids, model=MODEL, top_k=3)
        assert [t.id for t in sync.result(job, timeout=60).top_k] == top
        assert sync.status(job).worker == name

        async def through_asyncio() -> list[int]:
            async with AsyncPrefillClient.from_url(url) as client:
                job_id = await client.submit(tokens=token_ids, model=MODEL, top_k=3)
                return [t.id for t in (await client.result(job_id, timeout=60)).top_k]

        assert asyncio.run(through_asyncio()) == top

        created = httpx.post(f"{gateway.url}/v1/prefill", timeout=10,
                             json={"tokens": token_ids, "model": MODEL, "top_k": 3})
        assert created.status_code == 202, created.text
        done = httpx.get(f"{gateway.url}/v1/prefill/{created.json()['job_id']}/result",
                         params={"wait": 60}, timeout=70)
        assert done.status_code == 200, done.text
        assert [t["id"] for t in done.json()["top_k"]] == top
        health = httpx.get(f"{gateway.url}/health", timeout=10).json()
        assert health["redis"] is True and health["models"][MODEL]["live_workers"] >= 1
    finally:
        gateway.stop()
        worker.stop()
    # its KV checkpoints went to the store over the same URL (40 tokens in 4-token chunks)
    assert re.search(r"checkpoint \d+ at \d+ in force", worker.text()), worker.text()[-2000:]
