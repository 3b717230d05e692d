"""No secret ever appears in a log line, in status output or in an error message.

A worker and a gateway run on URLs holding passwords (the default user's, an ACL user's,
and the checkpoint store's); then errors are provoked: a failing job, unknown jobs and
models, wrong passwords for the worker, the CLI and the gateway, a bad checkpoint store
URL, and Redis going down under the worker and the gateway. Every log file, every CLI
stdout and stderr, every job status and error and every gateway response is searched for
each password, plain and URL-quoted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from urllib.parse import quote

import httpx
import pytest

from jobs import PrefillClient
from jobs.client import redacted
from tests.integration.processes import MODEL, GatewayProcess, WorkerProcess, ids, wait_for
from worker.redis_server import RedisServer, free_port

PASSWORD = "Pw4Default-9f3k"
USER, USER_PASSWORD = "alice", "Pw4Alice-x7Qz"
WRONG = "Pw4Wrong-k2Lm"
SECRETS = (PASSWORD, USER_PASSWORD, WRONG)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://alice:s3cret@host:6379/0", "redis://alice:***@host:6379/0"),
    ("redis://:s3cret@host/0", "redis://:***@host/0"),
    ("rediss://a:p%40ss@h:1/0?ssl_ca_certs=/etc/ca.pem",
     "rediss://a:***@h:1/0?ssl_ca_certs=/etc/ca.pem"),
    ("redis://h:1/0?password=s3cret&db=2", "redis://h:1/0?password=***&db=2"),
    ("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("file:///shared/ckpt", "file:///shared/ckpt"),
    ("redis", "redis"),
    ("redis://a:s3cret@[::1/0", "<unparseable URL>"),
])
def test_redacted_hides_passwords_only(url, shown):
    assert redacted(url) == shown


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True,
                          text=True, timeout=timeout)


class Seen:
    """Everything the test was shown, to search for secrets at the end."""

    def __init__(self):
        self.texts: list[tuple[str, str]] = []

    def add(self, what: str, text: str) -> str:
        self.texts.append((what, text))
        return text

    def run(self, what: str, *args: str) -> subprocess.CompletedProcess:
        done = cli(*args)
        self.add(f"{what} stdout", done.stdout)
        self.add(f"{what} stderr", done.stderr)
        return done

    def http(self, what: str, response: httpx.Response) -> httpx.Response:
        self.add(f"{what} ({response.status_code})", response.text)
        self.add(f"{what} headers", str(response.headers))
        return response

    def leaks(self) -> list[str]:
        needles = {s for secret in SECRETS for s in (secret, quote(secret, safe=""))}
        return [what for what, text in self.texts if any(n in text for n in needles)]


def test_no_secret_in_logs_status_or_errors(tmp_path):
    server = RedisServer(tmp_path, password=PASSWORD, users={USER: USER_PASSWORD}).start()
    url, user_url = server.url, server.url_as(USER, USER_PASSWORD)
    wrong = server.url_as(None, WRONG)
    dead = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    seen = Seen()
    worker = WorkerProcess(url, "sec-w1", tmp_path, "--checkpoint-store", user_url,
                           "--checkpoint-every", "1")
    gateway = GatewayProcess(user_url, tmp_path, "--log-level", "info", name="gw")
    bad_gateway = GatewayProcess(wrong, tmp_path, "--log-level", "info", name="gw-wrong")
    try:
        client = PrefillClient.from_url(user_url)
        good = client.submit(tokens=ids(40, 31), model=MODEL)
        failed = client.submit(prompt="word " * 5000, model=MODEL)  # over the context
        client.result(good, timeout=60)
        wait_for(lambda: client.status(failed).state.is_terminal, 60, "no failure", worker)
        for job in (good, failed):
            seen.add(f"status of {job}", str(client.status(job).to_dict()))
            seen.run("cli status", "status", "--json", "--redis", url, job)
            seen.run("cli result", "result", "--json", "--redis", user_url, job)
            seen.http("gateway status", httpx.get(f"{gateway.url}/v1/prefill/{job}"))
            seen.http("gateway result", httpx.get(f"{gateway.url}/v1/prefill/{job}/result"))
        seen.http("gateway unknown job", httpx.get(f"{gateway.url}/v1/prefill/nope"))
        seen.http("gateway unknown model", httpx.post(
            f"{gateway.url}/v1/prefill", json={"tokens": [2, 300], "model": "/etc/passwd"}))
        for path in ("/health", "/metrics", "/v1/models"):
            seen.http(f"gateway {path}", httpx.get(gateway.url + path))

        # wrong credentials and an unreachable Redis: refused with a reason, no secret
        refused = seen.run("worker, wrong password", "worker", "--redis", wrong,
                           "--model", MODEL, "--name", "sec-w2")
        assert refused.returncode == 2
        assert "Redis refused the URL's user or password" in refused.stderr
        for what, args in (("submit, wrong password", ("submit", "--redis", wrong)),
                           ("status, Redis down", ("status", "--redis", dead, good)),
                           ("reap, ACL user wrong", ("reap", "--redis",
                                                     server.url_as(USER, WRONG)))):
            done = seen.run(what, *args, *(("--prompt", "x") if what.startswith("submit")
                                           else ()))
            assert done.returncode == 2 and done.stderr.startswith("prefillq: error: ")
        bad_store = seen.run("bad checkpoint store", "worker", "--redis", url,
                             "--checkpoint-store", f"ftp://u:{PASSWORD}@h/x")
        assert bad_store.returncode == 2 and "ftp://u:***@h/x" in bad_store.stderr
        assert seen.http("wrong-password gateway /health",
                         httpx.get(bad_gateway.url + "/health")).status_code == 503
        assert seen.http("wrong-password gateway submit", httpx.post(
            f"{bad_gateway.url}/v1/prefill",
            json={"tokens": [2, 300], "model": MODEL})).status_code >= 500

        # Redis goes down under the worker and the gateway; the worker is told to stop
        server.stop()
        seen.http("gateway /health, Redis down", httpx.get(gateway.url + "/health"))
        down = seen.http("gateway status, Redis down",
                         httpx.get(f"{gateway.url}/v1/prefill/{good}", timeout=30))
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) != 0
    finally:
        for process in (gateway, bad_gateway):
            process.stop()
        worker.stop()
        server.stop()
    for log in sorted(tmp_path.glob("*.log")):
        seen.add(log.name, log.read_text())

    assert seen.leaks() == []
    assert len(seen.texts) > 40
    assert "Redis unreachable" in worker.text()
    assert f"to {redacted(user_url)}" in worker.text()  # the store, as it is shown
    # the outage is answered, typed, with the host and port but no password
    assert down.status_code == 503 and down.json()["error"]["type"] == "ConnectionError"
