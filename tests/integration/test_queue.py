"""The queue end to end: PrefillClient -> Redis (real server and fakeredis) -> PrefillWorker.

The worker runs in burst mode in the test's main thread (RQ installs signal handlers);
watchers follow jobs from other threads on their own connections.
"""

from __future__ import annotations

import logging
import re
import threading

import numpy as np
import pytest

from jobs import JobFailed, JobState, JobTimeout, PrefillClient, keys
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

MODEL = "gemma3-270m"
CHUNK_TOKENS = 128
TOL = 1e-3  # the exactness contract: max |diff| <= 1e-3 x max |logit|


def long_ids(reference_cases, n: int, offset: int = 0) -> list[int]:
    """`n` real token ids (BOS first) from the 6,144-token reference prompt."""
    ids = reference_cases[-1]["tokens"]
    return [ids[0], *ids[1 + offset : offset + n]]


def make_worker(connect, gemma, **kwargs) -> PrefillWorker:
    name = kwargs.pop("name", "w1")
    worker = PrefillWorker({MODEL: gemma}, connect(), WorkerSettings(**kwargs), name=name)
    worker.register_models()
    return worker


def chunk_order(caplog) -> list[str]:
    """Job ids in the order the worker ran their chunks (its per-chunk INFO line)."""
    pattern = re.compile(r"job (\w+) chunk \d+:")
    return [m.group(1) for r in caplog.records if (m := pattern.match(r.getMessage()))]


class Watcher(threading.Thread):
    """Follows one job with `PrefillClient.watch`; records every status it sees and whether
    a result was visible before the job finished."""

    def __init__(self, connect, job_id: str):
        super().__init__(daemon=True)
        self.client = PrefillClient(connect())
        self.job_id = job_id
        self.statuses = []
        self.early_results = []
        self.error = None

    def run(self) -> None:
        try:
            for status in self.client.watch(self.job_id, timeout=600):
                self.statuses.append(status)
                if not status.state.is_terminal:
                    self.early_results.append(self.result_before_finished())
        except Exception as e:  # surfaced by the test
            self.error = e

    def result_before_finished(self) -> bool:
        """Whether the job's state, result and logits, read in one MULTI (one instant), show
        a result or logits while the state is not yet terminal. Reading them apart races a
        publish that lands between the reads."""
        with self.client.redis.pipeline(transaction=True) as pipe:
            pipe.hget(keys.job(self.job_id), "state")
            pipe.hget(keys.job(self.job_id), "result")
            pipe.exists(keys.logits(self.job_id))
            state, result, logits = pipe.execute()
        return not JobState(state.decode()).is_terminal and (result is not None or logits == 1)


def test_two_long_prompts_interleave_and_match_in_process(
    redis_conn, gemma, reference_cases, caplog
):
    ids_a = long_ids(reference_cases, 700)
    ids_b = long_ids(reference_cases, 520, offset=1000)
    worker = make_worker(redis_conn, gemma, chunk_tokens=CHUNK_TOKENS)
    client = PrefillClient(redis_conn())
    job_a = client.submit(tokens=ids_a, model=MODEL, logits="full", top_k=5)
    job_b = client.submit(tokens=ids_b, model=MODEL, top_k=5)
    with pytest.raises(JobTimeout):
        client.result(job_a, timeout=0)
    watchers = [Watcher(redis_conn, job_a), Watcher(redis_conn, job_b)]
    for w in watchers:
        w.start()

    caplog.set_level(logging.INFO, logger="prefillq.worker")
    worker.work(burst=True)
    for w in watchers:
        w.join(timeout=60)
        assert w.error is None, w.error

    # chunks alternate a, b, a, b, ... until b (5 chunks) is done, then a (6 chunks) ends
    order = chunk_order(caplog)
    assert order == [job_a, job_b] * 5 + [job_a]

    for job_id, ids, watcher in ((job_a, ids_a, watchers[0]), (job_b, ids_b, watchers[1])):
        status = client.status(job_id)
        assert status.state == JobState.FINISHED
        assert (status.n_tokens, status.cursor, status.attempts) == (len(ids), len(ids), 1)
        assert status.chunks_done == -(-len(ids) // CHUNK_TOKENS)
        cursors = [s.cursor for s in watcher.statuses]
        assert cursors == sorted(cursors), "cursor never goes back"
        assert any(0 < c < len(ids) for c in cursors), f"no intermediate cursor in {cursors}"
        assert not any(watcher.early_results), "a result was visible before `finished`"

    expected_a = gemma.start_prefill(ids_a).run()
    result_a = client.result(job_a, timeout=0)
    logits_a = np.frombuffer(result_a.logits, dtype=np.float32)
    assert logits_a.shape == expected_a.shape
    assert np.abs(logits_a - expected_a).max() <= TOL * np.abs(expected_a).max()
    assert result_a.top_k[0].id == int(expected_a.argmax())

    expected_b = gemma.start_prefill(ids_b).run()
    result_b = client.result(job_b, timeout=0)
    assert result_b.logits is None
    top_b = np.argsort(-expected_b)[:5]
    assert [t.id for t in result_b.top_k] == top_b.tolist()
    for t in result_b.top_k:
        assert abs(t.logit - expected_b[t.id]) <= TOL * np.abs(expected_b).max()
        assert t.piece == gemma.tokenizer.piece(t.id)
    assert result_b.timings["compute_s"] > 0
    assert result_b.model_sha256 == gemma.sha256


def test_prompt_text_is_tokenized_by_the_worker(redis_conn, gemma, reference_cases):
    case = reference_cases[0]  # "The capital of France is"
    worker = make_worker(redis_conn, gemma)
    client = PrefillClient(redis_conn())
    job_id = client.submit(prompt=case["text"], model=MODEL, top_k=3)
    worker.work(burst=True)
    result = client.result(job_id, timeout=5)
    assert result.n_tokens == len(case["tokens"])
    assert [t.piece for t in result.top_k] == case["top10_pieces"][:3]


def test_over_context_prompt_fails_and_the_worker_keeps_serving(redis_conn, gemma):
    worker = make_worker(redis_conn, gemma)
    client = PrefillClient(redis_conn())
    too_long = client.submit(prompt="word " * 40_000, model=MODEL)
    fine = client.submit(prompt="Hello", model=MODEL, top_k=1)
    worker.work(burst=True)
    with pytest.raises(JobFailed) as failed:
        client.result(too_long, timeout=0)
    assert failed.value.error_type == "PromptTooLong"
    assert client.status(too_long).state == JobState.FAILED
    assert client.result(fine, timeout=0).top_k[0].piece == ","


def test_nothing_is_pickled_and_terminal_keys_expire(redis_conn, tiny):
    import zlib

    from jobs.serializer import unpackb

    conn = redis_conn()
    worker = PrefillWorker({"gemma3-tiny": tiny}, conn,
                           WorkerSettings(chunk_tokens=16, result_ttl_s=600, logits_ttl_s=60),
                                          name="w1")
    worker.register_models()
    client = PrefillClient(redis_conn(), result_ttl_s=600)
    done = client.submit(tokens=[2, *range(300, 340)], model="gemma3-tiny", logits="full")
    canceled = client.submit(tokens=[2, 300, 301], model="gemma3-tiny")
    client.cancel(canceled)
    # RQ's job payloads (deleted once a chunk ran: result_ttl=0) are zlib'd msgpack
    rq_payloads = [
        unpackb(zlib.decompress(conn.hget(key, "data")))
        for key in conn.keys("rq:job:*") if conn.hexists(key, "data")
    ]
    assert len(rq_payloads) == 2
    assert all(p[0] == "worker.tasks.advance_prefill" for p in rq_payloads)
    worker.work(burst=True)

    values = []
    for key in conn.keys("*"):
        kind = conn.type(key)
        if kind == b"string":
            values.append(conn.get(key))
        elif kind == b"hash":
            values.extend(conn.hgetall(key).values())
        elif kind == b"list":
            values.extend(conn.lrange(key, 0, -1))
        elif kind == b"stream":
            values.extend(v for _, e in conn.xrange(key) for v in e.values())
    pickle_headers = {b"\x80" + bytes([proto]) for proto in range(2, 6)}
    assert values and not [v for v in values if v[:2] in pickle_headers]

    assert 0 < conn.ttl(keys.job(done)) <= 600
    assert 0 < conn.ttl(keys.logits(done)) <= 60
    assert 0 < conn.ttl(keys.job(canceled)) <= 600
    assert conn.exists(keys.cancel(done)) == 0


def test_deepseek4_tiny_runs_through_the_queue_like_gemma(redis_conn, caplog):
    from model.registry import load_model

    ds4 = load_model("deepseek4-tiny")
    worker = PrefillWorker({"deepseek4-tiny": ds4}, redis_conn(),
                           WorkerSettings(chunk_tokens=37), name="w1")
    worker.register_models()
    client = PrefillClient(redis_conn())
    rng = np.random.default_rng(4)
    ids_a = [0, *rng.integers(2, 299, size=159).tolist()]  # BOS is id 0 in this vocab
    job_a = client.submit(tokens=ids_a, model="deepseek4-tiny", logits="full")
    job_b = client.submit(prompt="The number 7 is odd. " * 12, model="deepseek4-tiny", top_k=3)
    caplog.set_level(logging.INFO, logger="prefillq.worker")
    worker.work(burst=True)

    order = chunk_order(caplog)
    assert order[:4] == [job_a, job_b, job_a, job_b], "the two jobs interleave"
    expected = ds4.start_prefill(ids_a).run()  # one pass
    got = np.frombuffer(client.result(job_a, timeout=0).logits, dtype=np.float32)
    tol = TOL * np.abs(expected).max()
    top2 = np.sort(expected)[-2:]
    assert top2[1] - top2[0] > tol, "argmax margin too small for the check to mean anything"
    assert np.abs(got - expected).max() <= tol
    assert int(got.argmax()) == int(expected.argmax())
    status_b = client.status(job_b)
    assert status_b.state == JobState.FINISHED and status_b.chunks_done > 1
    assert len(client.result(job_b, timeout=0).top_k) == 3
