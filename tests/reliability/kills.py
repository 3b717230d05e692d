"""Helpers of the SIGKILL tests: waiting for a worker to pause at a fault point, killing it,
and checking that every job ended exactly once."""

from __future__ import annotations

import signal

import numpy as np

from jobs import JobFailed, JobState, PrefillClient, keys
from tests.integration.processes import WorkerProcess, wait_for

from .events import EventLog


def paused(worker: WorkerProcess, job: str, point: str) -> bool:
    return f"fault: job {job} paused {point}" in worker.text()


def kill(worker: WorkerProcess) -> None:
    worker.signal(signal.SIGKILL)
    worker.wait()


def kill_when_paused(workers: list[WorkerProcess], job: str, point: str,
                     timeout: float = 120) -> WorkerProcess:
    """SIGKILL the live worker of `workers` that pauses `job` at `point` (`worker.faults`)."""
    found: list[WorkerProcess] = []

    def one_paused() -> bool:
        found[:] = [w for w in workers if w.proc.poll() is None and paused(w, job, point)]
        return bool(found)

    wait_for(one_paused, timeout, f"no worker paused job {job} {point}")
    kill(found[0])
    return found[0]


def assert_ended_once(client: PrefillClient, events: EventLog, jobs: dict[str, list[int]],
                      tiny, timeout: float = 120) -> dict[str, str]:
    """Every job of `jobs` (id -> token ids) ends exactly once: ``finished`` with the
    one-pass logits (the full float32 vector), or ``failed`` with ``WorkerLost`` after its
    ``max_attempts``; one terminal event each, and no logits for a failed job. Returns the
    state each ended in."""
    ended = {}
    for job, token_ids in jobs.items():
        try:
            result = client.result(job, timeout=timeout)
        except JobFailed as failed:
            assert failed.error_type == "WorkerLost", failed
            record = client.redis.hmget(keys.job(job), "failures", "max_attempts")
            assert record[0] == record[1], f"{job} failed before max_attempts: {record}"
            assert client.redis.exists(keys.logits(job)) == 0
            ended[job] = "failed"
            continue
        expected = tiny.start_prefill(token_ids).run()
        got = np.frombuffer(result.logits, dtype=np.float32)
        assert got.shape == expected.shape, f"{job}: logits of {got.shape}"
        assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max(), job
        assert [t.id for t in result.top_k] == np.argsort(-expected)[:1].tolist()
        ended[job] = "finished"
    events.settle()
    for job, state in ended.items():
        assert client.status(job).state == JobState(state)
        assert events.count(job, "finished") == (state == "finished"), job
        assert events.count(job, "failed") == (state == "failed"), job
    return ended
