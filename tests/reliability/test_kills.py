"""SIGKILL worker processes on a real redis-server at every point of a job's life: after it
was dequeued but before it was taken, between its last chunk and its publish (both
deterministic, through `worker.faults` pauses), and at random times (between chunks,
mid-chunk, mid-admission). Every job ends exactly once: ``finished`` with the one-pass
logits, or ``failed`` with ``WorkerLost`` after ``max_attempts``; none stays queued or
prefilling; no logits are published twice or in part (one ``finished`` event per job, and the
logits key holds the whole vector).
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from jobs import JobState, PrefillClient, keys
from tests.integration.processes import MODEL, ids, wait_for

from .kills import assert_ended_once, kill, kill_when_paused

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


@pytest.mark.parametrize("n_jobs, n_kills, longest", [
    pytest.param(10, 3, 800, id="10-jobs-3-kills"),
    pytest.param(24, 10, 2000, id="24-jobs-10-kills", marks=pytest.mark.long),
])
def test_random_kills_over_many_jobs(server, workers, events, tiny, n_jobs, n_kills, longest):
    rng = random.Random(n_jobs)
    client = PrefillClient.from_url(server.url)
    args = ("--max-active", "2", "--checkpoint-every", "3")
    names = (f"w{i}" for i in itertools.count(1))
    live = [workers(next(names), *args) for _ in range(2)]
    jobs = {}
    seeds = iter(range(n_jobs))

    def submit(n: int) -> None:
        for seed in itertools.islice(seeds, n):
            token_ids = ids(rng.randint(100, longest), 100 + seed)
            jobs[client.submit(tokens=token_ids, model=MODEL, top_k=1, logits="full")] = \
                token_ids

    killed = []
    batch = -(-n_jobs // (n_kills + 1))  # a batch before each kill: there is work to kill
    for _ in range(n_kills):
        submit(batch)
        # a worker holding jobs, at a random moment of its work: between chunks, mid-chunk,
        # mid-admission or mid-publish
        wait_for(lambda live=live: holding(client, live) or all_ended(client, jobs), 120,
                 "no worker took a job")  # (all ended: an idle worker dies)
        time.sleep(rng.uniform(0, 0.3))
        victim = rng.choice(holding(client, live) or live)
        kill(victim)
        killed.append(victim.name)
        live = [w for w in live if w is not victim] + [workers(next(names), *args)]
    submit(n_jobs)  # the rest
    assert len(jobs) == n_jobs

    assert_ended_once(client, events, jobs, tiny)
    wait_for(lambda: not client.redis.sismember(keys.WORKERS, killed[-1]), 60,
             "the last killed worker was never reaped")
    for name in killed:
        assert not client.redis.exists(keys.worker_jobs(name), keys.worker_taking(name))
    assert all(w.proc.poll() is None for w in live)


def holding(client: PrefillClient, live: list) -> list:
    """The live workers that hold or are taking a job now."""
    return [w for w in live if w.proc.poll() is None and client.redis.exists(
        keys.worker_jobs(w.name), keys.worker_taking(w.name))]


def all_ended(client: PrefillClient, jobs) -> bool:
    return all(client.status(j).state.is_terminal for j in jobs)


def test_a_kill_inside_a_step_of_several_jobs_ends_each_job_once(server, workers, events,
                                                                  tiny):
    """A worker stepping four jobs together dies between its step's forward pass and its
    round trip (the shortest job pauses before its publish, the others' chunks are landed
    and the next step is launched): every job is requeued and ends once, exactly."""
    client = PrefillClient.from_url(server.url)
    packed = ("--max-batch-jobs", "4", "--max-active", "4")
    first = workers("p1", *packed, faults="pause_before_publish:tokens=11:attempts=1")
    jobs = {}
    for n, seed in ((40, 21), (11, 22), (36, 23), (44, 24)):  # 10, 3, 9 and 11 chunks of 4
        token_ids = ids(n, seed)
        jobs[client.submit(tokens=token_ids, model=MODEL, top_k=1, logits="full")] = token_ids
    short = list(jobs)[1]
    dead = kill_when_paused([first], short, "before_publish")
    held = [j for j in jobs if client.status(j).worker == dead.name]
    assert held == list(jobs), "the four jobs were on the killed worker"
    assert all(client.status(j).state == JobState.PREFILLING for j in jobs)
    survivor = workers("p2", *packed)
    ended = assert_ended_once(client, events, jobs, tiny)
    assert set(ended.values()) == {"finished"}
    assert all(client.status(j).attempts == 2 for j in jobs)
    assert survivor.proc.poll() is None
