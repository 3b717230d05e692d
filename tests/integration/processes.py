"""Worker processes for the integration tests: ``prefillq worker`` as a child process on
the tiny Gemma 3 (`gemma3-tiny`) with 4-token chunks, so a prefill lasts long enough to be
interrupted, and a 2 s heartbeat TTL, so dead workers are found quickly; and the gateway,
``prefillq serve``, as a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import redis

from jobs import PrefillClient, keys
from worker.faults import FAULTS_ENV
from worker.redis_server import RedisServer, free_port

MODEL = "gemma3-tiny"


def ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2, *rng.integers(260, 365, size=n - 1).tolist()]


MODULE_MAIN = [sys.executable, "-m", "worker"]


class WorkerProcess:
    """``prefillq worker`` as a child process; its log goes to a file. `env` adds to the
    environment it inherits (e.g. ``PREFILLQ_FAULTS``, `worker.faults`); the constructor
    returns once its heartbeat is up, or at once if not `registered`."""

    def __init__(self, url: str, name: str, tmp_path, *extra: str,
                 env: dict[str, str] | None = None, registered: bool = True):
        self.name, self.url = name, url
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*MODULE_MAIN, "worker", "--redis", url, "--name", name,
             "--model", MODEL, "--chunk-tokens", "4", "--heartbeat-ttl", "2", *extra],
            stdout=self.log, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        if registered:
            wait_for(lambda: redis.Redis.from_url(url).exists(keys.worker_heartbeat(name)),
                     60, f"worker {name} did not register", self)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class GatewayProcess:
    """``prefillq serve`` as a child process; its log goes to a file."""

    def __init__(self, redis_url: str, tmp_path, *extra: str, name: str = "gateway"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--redis", redis_url,
             "--port", str(self.port), "--log-level", "warning", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._up, 60, "the gateway did not start")

    def _up(self) -> bool:
        import httpx  # the gateway extra's

        if self.proc.poll() is not None:
            pytest.fail(f"the gateway exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_for(predicate, timeout: float, message: str, worker: WorkerProcess | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if worker is not None and worker.proc.poll() is not None:
            pytest.fail(f"{message}: worker exited\n{worker.log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.05)


def long_job_in_flight(client: PrefillClient, worker: WorkerProcess, seed: int,
                       **submit) -> tuple[str, list[int]]:
    """Submit a 2,000-token job (500 chunks of 4) and wait until `worker` is 10 chunks in."""
    token_ids = ids(2000, seed)
    job = client.submit(tokens=token_ids, model=MODEL, **submit)
    wait_for(lambda: client.status(job).cursor >= 40, 60,
             f"{worker.name} never advanced the job", worker)
    return job, token_ids


@contextmanager
def redis_and_worker(tmp: Path, name: str, *worker_args: str):
    """A real redis-server in `tmp` and one worker process `name` on it (`WorkerProcess`,
    `worker_args` its extra flags), once registered; yields ``(server, worker)`` and stops
    both (the server also when the worker fails to start)."""
    server = RedisServer(tmp).start()
    try:
        worker = WorkerProcess(server.url, name, tmp, *worker_args)
        try:
            yield server, worker
        finally:
            worker.stop()
    finally:
        server.stop()


def expected_top(tiny, token_ids, k):
    logits = tiny.start_prefill(token_ids).run()
    return np.argsort(-logits)[:k].tolist(), logits


@pytest.fixture
def server(tmp_path):
    """A real redis-server with AOF on, for one test."""
    srv = RedisServer(tmp_path, appendonly=True).start()
    yield srv
    srv.stop()


@pytest.fixture
def workers(server, tmp_path):
    """``start(name, *args, faults=None, url=None, registered=True)``: a worker process on
    `server` (or on `url`), with ``$PREFILLQ_FAULTS`` set to `faults` when given, once
    registered (`WorkerProcess`); all are stopped at the end."""
    started = []

    def start(name: str, *extra: str, faults: str | None = None, url: str | None = None,
              registered: bool = True) -> WorkerProcess:
        env = None if faults is None else {FAULTS_ENV: faults}
        w = WorkerProcess(url or server.url, name, tmp_path, *extra, env=env,
                          registered=registered)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
