"""Shared fixtures: the real Gemma 3 270M model (loaded once per session) and its reference data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    """llama.cpp's token ids and top-10 final logits for Gemma 3 270M (tests/data)."""
    return json.loads((DATA / "gemma3-270m-llamacpp.json").read_text())["cases"]


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma 3 270M Q4_K_M model, float32 on CPU (a `model.registry.LoadedModel`)."""
    from model.registry import load_model

    return load_model("gemma3-270m")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real ``redis-server`` on a free port for this test session; yields its URL.

    Persistence is off. Fails (does not skip) when the binary is missing: CI installs it.
    """
    import shutil
    import subprocess
    import time

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(params=["fakeredis", "redis"])
def redis_conn(request):
    """A clean connection factory: fakeredis (with Lua) or the real server, per test.

    Returns a zero-argument callable giving a new connection to the same server, so a
    test can have a worker, a client and a watcher on separate connections.
    """
    if request.param == "fakeredis":
        import fakeredis

        server = fakeredis.FakeServer()

        def connect():
            return fakeredis.FakeStrictRedis(server=server)
    else:
        import redis

        url = request.getfixturevalue("redis_server")

        def connect():
            return redis.Redis.from_url(url)

    connect().flushall()
    return connect
