"""The worker runs only prefillq's job function: RQ jobs a foreign client puts on its queues
(through RQ with prefillq's serializer, or written straight into Redis) that name another
function, other arguments, RQ callbacks or webhooks, or carry a payload msgpack cannot
decode, are refused and recorded, and nothing of them runs; the worker goes on serving.

Each foreign job would leave a mark if any of it ran: a file it creates, a module whose
import creates a file, a connection to a listening socket.
"""

from __future__ import annotations

import logging
import pickle
import socket
import sys
import threading
import zlib

import pytest
import redis
from rq import Callback
from rq.job import Job, JobStatus

from jobs import JobState, PrefillClient
from jobs.queues import ADMIT_FUNCTION, intake_queue, own_queue, rq_queue_key
from jobs.serializer import MsgpackSerializer, packb
from tests.worker.helpers import CHUNK, MODEL, ids
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

EVIL_MODULE = "prefillq_evil_hook"


@pytest.fixture
def conn(redis_server):
    connection = redis.Redis.from_url(redis_server)
    connection.flushall()
    return connection


@pytest.fixture
def worker(redis_server, tiny, conn):
    w = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(redis_server),
                      WorkerSettings(chunk_tokens=CHUNK), name="al1")
    w.register_models()
    return w


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module on sys.path whose import, or whose `hook`, creates a file; yields the
    files' folder. The test fails if anything imported it."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / f"{EVIL_MODULE}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marks)!r}, 'imported').touch()\n"
        "def hook(*args, **kwargs):\n"
        f"    pathlib.Path({str(marks)!r}, 'called').touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marks
    assert EVIL_MODULE not in sys.modules
    assert list(marks.iterdir()) == []


def refusals(conn, rq_ids: list[str]) -> dict[str, str]:
    """The recorded failure (RQ's exc_info) of each RQ job, which must be `failed`."""
    out = {}
    for rq_id in rq_ids:
        job = Job.fetch(rq_id, connection=conn, serializer=MsgpackSerializer)
        assert job.get_status() == JobStatus.FAILED, rq_id
        out[rq_id] = job.latest_result().exc_string
    return out


def raw_job(conn, queue_name: str, rq_id: str, data: bytes, **fields) -> str:
    """An RQ job written straight into Redis (HSET and RPUSH, as a foreign client could)."""
    conn.hset(f"rq:job:{rq_id}", mapping={"data": data, "origin": queue_name,
                                           "status": "queued", "description": "raw",
                                           "created_at": "2025-01-01T00:00:00.000000Z",
                                           **fields})
    conn.sadd("rq:queues", rq_queue_key(queue_name))
    conn.rpush(rq_queue_key(queue_name), rq_id)
    return rq_id


def test_foreign_functions_are_refused_recorded_and_never_run(conn, worker, tmp_path, caplog):
    mark = tmp_path / "ran"
    queue = intake_queue(conn, MODEL)
    foreign = {
        "os.system": queue.enqueue_call("os.system", args=(f"touch {mark}",)).id,
        "builtins.eval": queue.enqueue_call(
            "builtins.eval", args=(f"__import__('pathlib').Path({str(mark)!r}).touch()",)).id,
        "subprocess.call": queue.enqueue_call("subprocess.call", args=(["touch", str(mark)],)).id,
        "os.system (own queue)": own_queue(conn, "al1").enqueue_call(
            "os.system", args=(f"touch {mark}",)).id,
    }
    client = PrefillClient(conn)
    good = client.submit(tokens=ids(40, 1), model=MODEL)
    caplog.set_level(logging.ERROR, logger="prefillq.worker")
    worker.work(burst=True)

    assert not mark.exists()
    recorded = refusals(conn, list(foreign.values()))
    for name, rq_id in foreign.items():
        func = name.split()[0]
        assert recorded[rq_id] == (f"JobRefused: function {func!r} is not allow-listed "
                                   f"(only {ADMIT_FUNCTION} runs here)")
        assert any(rq_id in r.getMessage() and "refused" in r.getMessage()
                   for r in caplog.records)
    assert client.status(good).state == JobState.FINISHED


def test_raw_payloads_the_serializer_cannot_decode_or_that_misuse_the_function(
        conn, worker, tmp_path, caplog):
    mark = tmp_path / "ran"
    queue = intake_queue(conn, MODEL).name
    client = PrefillClient(conn)
    target = client.submit(tokens=ids(20, 2), model=MODEL)

    def tuple_of(*fields) -> bytes:  # RQ's payload: zlib'd msgpack of the 4-tuple
        return zlib.compress(packb(list(fields)))

    cases = {
        "raw os.system": (tuple_of("os.system", None, [f"touch {mark}"], {}),
                          "function 'os.system' is not allow-listed"),
        "junk bytes": (b"\x00\xffnot msgpack", "payload cannot be decoded"),
        "a pickle": (zlib.compress(pickle.dumps(("os.system", None, (f"touch {mark}",), {}))),
                     "payload cannot be decoded"),
        "a map, not RQ's tuple": (zlib.compress(packb({"func": ADMIT_FUNCTION})),
                                  "payload cannot be decoded"),
        "truncated": (tuple_of(ADMIT_FUNCTION, None, [target], {})[:-3],
                      "payload cannot be decoded"),
        "keyword arguments": (tuple_of(ADMIT_FUNCTION, None, [target], {"x": 1}),
                              "takes one job id and nothing else"),
        "an instance": (tuple_of(ADMIT_FUNCTION, "os", [target], {}),
                        "takes one job id and nothing else"),
        "two arguments": (tuple_of(ADMIT_FUNCTION, None, [target, "x"], {}),
                          "takes one job id and nothing else"),
        "a non-str id": (tuple_of(ADMIT_FUNCTION, None, [7], {}),
                         "takes one job id and nothing else"),
    }
    rq_ids = {name: raw_job(conn, queue, f"raw-{i}", data)
              for i, (name, (data, _)) in enumerate(cases.items())}
    good = client.submit(tokens=ids(40, 3), model=MODEL)
    worker.work(burst=True)

    assert not mark.exists()
    recorded = refusals(conn, list(rq_ids.values()))
    for name, (_, reason) in cases.items():
        assert recorded[rq_ids[name]].startswith("JobRefused: ") and reason in \
            recorded[rq_ids[name]], name
    # the refused executions did not touch the job they named; its own execution ran it
    assert client.status(target).state == JobState.FINISHED
    assert client.status(target).attempts == 1
    assert client.status(good).state == JobState.FINISHED


def test_rq_callbacks_are_never_imported_or_called(conn, worker, evil_module):
    client = PrefillClient(conn)
    queue = intake_queue(conn, MODEL)
    rq_ids = []
    for hook in ("on_success", "on_failure", "on_stopped"):
        target = client.submit(tokens=ids(20, 4), model=MODEL)
        # prefillq's own function and a real job id: only the callback is foreign
        rq_ids.append(queue.enqueue_call(ADMIT_FUNCTION, args=(target,),
                                         **{hook: Callback(f"{EVIL_MODULE}.hook")}).id)
    worker.work(burst=True)
    for exc_string in refusals(conn, rq_ids).values():
        assert exc_string == "JobRefused: RQ callbacks and webhooks are not allowed"


def test_a_foreign_started_registry_entry_never_runs_its_failure_callback(
        conn, worker, evil_module):
    # RQ's maintenance fails abandoned "started" jobs and would call their failure callback
    queue = intake_queue(conn, MODEL)
    job = queue.enqueue_call(ADMIT_FUNCTION, args=("x",), on_failure=Callback(
        f"{EVIL_MODULE}.hook"))
    conn.lrem(queue.key, 0, job.id)
    conn.hset(job.key, "status", JobStatus.STARTED.value)
    conn.zadd(queue.started_job_registry.key, {f"{job.id}:exec-1": 1})  # long expired
    worker.work(burst=True)
    assert conn.zcard(queue.started_job_registry.key) == 0, "maintenance did not run"


def test_webhooks_are_never_sent(conn, worker):
    webhook = pytest.importorskip("rq.webhook")  # RQ >= 3
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    hits = []

    def accept() -> None:
        try:
            while True:
                hits.append(listener.accept())
        except OSError:  # timed out, or closed at the end
            pass

    url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    queue = intake_queue(conn, MODEL)
    client = PrefillClient(conn)
    rq_ids = [
        queue.enqueue_call("os.system", args=("true",),
                           webhooks=[webhook.Webhook(url, "failed")]).id,
        queue.enqueue_call(ADMIT_FUNCTION, args=(client.submit(tokens=ids(20, 5), model=MODEL),),
                           webhooks=[webhook.Webhook(url, "finished"),
                                     webhook.Webhook(url, "failed", method="POST")]).id,
    ]
    worker.work(burst=True)
    thread = threading.Thread(target=accept)
    thread.start()
    thread.join()
    listener.close()
    assert hits == []
    assert set(refusals(conn, rq_ids)) == set(rq_ids)
