"""Models are chosen by name from the worker's configuration, never by a path or URL a
client sends: such names are refused at submit (UnknownModel, as no worker registered
them), and a job record naming one, written straight into Redis on a worker's queue, fails
with ``UnknownModel`` while the worker opens no file and connects nowhere (Python's audit
events ``open`` and ``socket.connect`` show every file and socket the process touches)."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest
import redis

from jobs import AsyncPrefillClient, JobFailed, JobState, PrefillClient, UnknownModel, keys
from jobs.limits import Limits
from jobs.protocol import submitted_record
from jobs.queues import enqueue_admission, intake_queue, own_queue
from tests.worker.helpers import CHUNK, MODEL, ids
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker


class Touched:
    """Paths opened and addresses connected to while `watching` (an audit hook: it cannot
    be removed, so it records only while switched on)."""

    def __init__(self):
        self.watching = False
        self.opened: list[str] = []
        self.connected: list[object] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.watching:
            return
        if event == "open":
            self.opened.append(str(args[0]))
        elif event == "socket.connect":
            self.connected.append(args[1])


_touched = Touched()


@pytest.fixture
def touched():
    _touched.opened.clear()
    _touched.connected.clear()
    _touched.watching = True
    yield _touched
    _touched.watching = False


@pytest.fixture
def hostile_names(tmp_path):
    """Model names that are paths or URLs; the files exist, so opening one would work."""
    evil = tmp_path / "evil.gguf"
    evil.write_bytes(b"GGUF" + bytes(64))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "names": ["/etc/passwd", "../x", "../../etc/passwd", str(evil), f"file://{evil}",
                  f"http://127.0.0.1:{port}/evil.gguf", f"https://127.0.0.1:{port}/m",
                  f"gemma3-270m={evil}", f"{MODEL}={evil}", "~/evil.gguf", f"{MODEL}/../x"],
        "paths": {"/etc/passwd", str(evil)},
        "port": port,
    }


@pytest.fixture
def conn(redis_server):
    connection = redis.Redis.from_url(redis_server)
    connection.flushall()
    return connection


@pytest.fixture
def worker(redis_server, tiny, conn):
    w = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(redis_server),
                      WorkerSettings(chunk_tokens=CHUNK), name="mn1")
    w.register_models()
    return w


def test_path_and_url_names_are_unknown_models_at_submit(conn, worker, redis_server,
                                                         hostile_names):
    client = PrefillClient(conn)

    async def submit_async(name: str) -> None:
        async with AsyncPrefillClient.from_url(redis_server) as aclient:
            await aclient.submit(tokens=[2, 300], model=name)

    for name in hostile_names["names"]:
        with pytest.raises(UnknownModel, match="no registered worker serves model"):
            client.submit(tokens=[2, 300], model=name)
        with pytest.raises(UnknownModel):
            asyncio.run(submit_async(name))
    assert set(client.models()) == {MODEL}


def raw_job(conn, model: str, queue, tokens: list[int] | None = None) -> str:
    """A valid job record naming `model`, written straight into Redis and put on `queue`
    (bypassing `submit`'s checks, as a client that writes Redis could)."""
    record = submitted_record(Limits(), prompt=None, tokens=tokens or ids(20, 1), messages=None,
                              add_generation_prompt=True, model=model, top_k=3,
                              logits="top_k", parse_special=True, session=None, priority=0,
                              chunk_tokens=None, idempotency_key=None, max_attempts=3,
                              prompt_logprobs=None)
    conn.hset(keys.job(record.job_id), mapping=record.to_hash())
    enqueue_admission(queue, record.job_id)
    return record.job_id


def test_a_raw_job_naming_a_path_or_url_fails_typed_and_nothing_is_opened(
        conn, worker, hostile_names, touched):
    client = PrefillClient(conn)
    queues = [intake_queue(conn, MODEL), own_queue(conn, "mn1")]
    raw = {name: raw_job(conn, name, queues[i % 2])
           for i, name in enumerate(hostile_names["names"])}
    good = client.submit(tokens=ids(40, 2), model=MODEL)
    worker.work(burst=True)
    touched.watching = False

    for name, job_id in raw.items():
        with pytest.raises(JobFailed) as failed:
            client.result(job_id, timeout=0)
        assert failed.value.error_type == "UnknownModel"
        assert f"no registered worker serves model {name!r}" in failed.value.message
    assert client.status(good).state == JobState.FINISHED
    assert not set(touched.opened) & hostile_names["paths"]
    assert not [o for o in touched.opened if "evil" in o or o.startswith(("http", "file:"))]
    assert not [a for a in touched.connected
                if isinstance(a, tuple) and a[1:2] == (hostile_names["port"],)]
    assert touched.connected, "the audit hook saw no connection at all (to Redis)"
    touched.watching = True  # and it sees opens
    evil = next(p for p in hostile_names["paths"] if "evil" in p)
    open(evil, "rb").close()
    assert evil in touched.opened


def test_a_job_routed_to_a_worker_without_its_model_goes_to_its_intake(conn, worker,
                                                                       redis_server):
    from model.registry import load_model

    other = PrefillWorker({"deepseek4-tiny": load_model("deepseek4-tiny")},
                          redis.Redis.from_url(redis_server), WorkerSettings(chunk_tokens=CHUNK),
                          name="mn2")
    other.register_models()
    # as a session's next job is routed to the worker that kept the session
    job_id = raw_job(conn, "deepseek4-tiny", own_queue(conn, "mn1"), list(range(2, 40)))
    worker.work(burst=True)
    client = PrefillClient(conn)
    assert client.status(job_id).state == JobState.QUEUED
    assert len(intake_queue(conn, "deepseek4-tiny")) == 1
    other.work(burst=True)
    assert client.status(job_id).state == JobState.FINISHED
    assert client.status(job_id).worker == "mn2"
