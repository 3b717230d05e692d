"""SIGKILL worker processes on a real redis-server at every point of a job's life: after it
was dequeued but before it was taken, between its last chunk and its publish (both
deterministic, through `worker.faults` pauses), and at random times (between chunks,
mid-chunk, mid-admission). Every job ends exactly once: ``finished`` with the one-pass
logits, or ``failed`` with ``WorkerLost`` after ``max_attempts``; none stays queued or
prefilling; no logits are published twice or in part (one ``finished`` event per job, and the
logits key holds the whole vector).
"""

from __future__ import annotations

from jobs import JobState, PrefillClient, keys
from tests.integration.processes import MODEL, ids

from .kills import assert_ended_once, kill_when_paused

# prompt lengths (tokens) that name the jobs the fault plan pauses
STARTS, PUBLISHES, LOST = 45, 61, 53
AT_PUBLISH = f"pause_before_publish:tokens={PUBLISHES}:attempts=1;" \
             f"pause_before_publish:tokens={LOST}"
# a job killed before its start is still in attempt 1 (never started): only the first
# workers pause it there
PLAN = f"pause_before_start:tokens={STARTS}:attempts=1;{AT_PUBLISH}"
ONE_AT_A_TIME = ("--max-active", "1")


def test_kills_at_the_admission_and_publish_points(server, workers, events, tiny):
    client = PrefillClient.from_url(server.url)
    live = [workers(f"w{i}", *ONE_AT_A_TIME, faults=PLAN) for i in (1, 2)]
    jobs = {}
    for n, seed in ((STARTS, 1), (PUBLISHES, 2), (LOST, 3)):
        token_ids = ids(n, seed)
        job = client.submit(tokens=token_ids, model=MODEL, top_k=1, logits="full",
                            max_attempts=2 if n == LOST else 3)
        jobs[job] = token_ids
    starts, publishes, lost = jobs

    # dequeued and prepared, not yet taken: it is queued in its record, in no RQ queue
    dead = kill_when_paused(live, starts, "before_start")
    status = client.status(starts)
    assert (status.state, status.attempts) == (JobState.QUEUED, 0)
    live = [w for w in live if w is not dead] + [workers("w3", *ONE_AT_A_TIME, faults=AT_PUBLISH)]

    # the last chunk ran, the logits are computed: not published
    for job, name in ((publishes, "w4"), (lost, "w5"), (lost, "w6")):
        dead = kill_when_paused(live, job, "before_publish")
        status = client.status(job)
        assert status.state == JobState.PREFILLING and status.worker == dead.name
        assert client.redis.exists(keys.logits(job)) == 0
        live = [w for w in live if w is not dead] + [workers(name, *ONE_AT_A_TIME,
                                                             faults=AT_PUBLISH)]

    ended = assert_ended_once(client, events, jobs, tiny)
    assert ended == {starts: "finished", publishes: "finished", lost: "failed"}
    assert client.status(starts).attempts == 1  # never taken before its kill
    assert client.status(publishes).attempts == 2
    assert client.status(lost).attempts == 2
    assert all(w.proc.poll() is None for w in live)
