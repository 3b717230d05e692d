"""`jobs.stats`: bucket assignment, decoding, and the read plan's round trips (fakeredis and
pure planner runs; the counts a real worker records are in tests/worker/test_stats_recording.py).
"""

from __future__ import annotations

import fakeredis
import pytest

from jobs import keys, stats
from jobs.queues import enqueue_new, rq_queue_key
from jobs.stats import CHUNK_SECONDS_BUCKETS, bucket_field, read_cluster_stats_sync, read_plan


@pytest.fixture
def conn():
    return fakeredis.FakeStrictRedis(server=fakeredis.FakeServer())


def record(conn, *chunks: tuple[float, int]) -> None:
    with conn.pipeline(transaction=False) as pipe:
        for seconds, tokens in chunks:
            stats.record_chunks(pipe, [(seconds, tokens)])
        pipe.execute()


@pytest.mark.parametrize(("seconds", "bound"), [
    (0.0, "0.005"), (0.005, "0.005"), (0.0050001, "0.01"), (0.01, "0.01"),
    (0.0999, "0.1"), (1.0, "1"), (1.0001, "2.5"), (10.0, "10"), (10.0001, "+Inf"),
    (1e6, "+Inf"),
])
def test_a_chunk_falls_in_the_first_bucket_whose_bound_it_does_not_exceed(seconds, bound):
    assert bucket_field(seconds) == f"chunk_le:{bound}"


def test_every_bound_has_its_own_field_and_inf_comes_last():
    assert list(CHUNK_SECONDS_BUCKETS) == sorted(set(CHUNK_SECONDS_BUCKETS))
    assert len(stats.BUCKET_FIELDS) == len(set(stats.BUCKET_FIELDS)) == len(
        CHUNK_SECONDS_BUCKETS) + 1
    assert stats.BUCKET_FIELDS[-1] == "chunk_le:+Inf"


def test_an_empty_redis_decodes_to_all_zeros(conn):
    s = read_cluster_stats_sync(conn)
    assert (s.submitted, s.finished, s.failed, s.canceled, s.tokens_prefilled) == (0,) * 5
    assert (s.queued, s.routed, s.prefilling, s.workers_alive, s.workers_dead) == (0,) * 5
    assert s.queue_depth == {} and s.live_workers == {}
    h = s.chunks
    assert h.bounds == CHUNK_SECONDS_BUCKETS
    assert h.cumulative == (0,) * (len(CHUNK_SECONDS_BUCKETS) + 1)
    assert (h.sum_seconds, h.count) == (0.0, 0)
    assert s.totals() == {"submitted": 0, "finished": 0, "failed": 0, "canceled": 0}


def test_bucket_counts_are_cumulative_and_end_at_the_count(conn):
    record(conn, (0.004, 16), (0.005, 16), (0.3, 7), (0.3, 7), (2.0, 1), (11.0, 3))
    s = read_cluster_stats_sync(conn)
    h = s.chunks
    by_bound = dict(zip((*CHUNK_SECONDS_BUCKETS, float("inf")), h.cumulative, strict=True))
    assert by_bound == {0.005: 2, 0.01: 2, 0.025: 2, 0.05: 2, 0.1: 2, 0.25: 2, 0.5: 4,
                        1.0: 4, 2.5: 5, 5.0: 5, 10.0: 5, float("inf"): 6}
    assert h.count == 6
    assert h.sum_seconds == pytest.approx(0.004 + 0.005 + 0.3 + 0.3 + 2.0 + 11.0)
    assert s.tokens_prefilled == 16 + 16 + 7 + 7 + 1 + 3


def test_one_chunk_costs_three_commands_on_the_stats_hash_only(conn):
    with conn.pipeline(transaction=False) as pipe:
        stats.record_chunks(pipe, [(0.02, 16)])
        assert len(pipe.command_stack) == stats.COMMANDS_PER_CHUNK == 3
        assert {args[1] for args, _ in pipe.command_stack} == {keys.STATS}
        pipe.execute()


def test_a_steps_chunks_cost_a_command_per_bucket_and_count_as_one_by_one(conn):
    chunks = [(0.02, 16), (0.02, 7), (0.3, 5), (0.021, 1)]
    with conn.pipeline(transaction=False) as pipe:
        stats.record_chunks(pipe, chunks)
        assert len(pipe.command_stack) == 2 + 2  # tokens, seconds, two buckets
        pipe.execute()
    together = read_cluster_stats_sync(conn)
    conn.flushall()
    record(conn, *chunks)
    assert read_cluster_stats_sync(conn) == together


def test_terminal_states_count_apart_and_nothing_else_is_terminal(conn):
    with conn.pipeline(transaction=False) as pipe:
        stats.record_terminal(pipe, "finished")
        stats.record_terminal(pipe, stats.JobState.FAILED, 2)
        stats.record_terminal(pipe, b"canceled".decode())
        stats.record_submitted(pipe)
        pipe.execute()
        for state in ("queued", "prefilling"):
            with pytest.raises(ValueError):
                stats.record_terminal(pipe, state)
    assert read_cluster_stats_sync(conn).totals() == {
        "submitted": 1, "finished": 1, "failed": 2, "canceled": 1}
    assert [stats.terminal(o) for o in (b"finished", "canceled", "fenced", "continue",
                                        "queued", b"requested")] == [
        "finished", "canceled", None, None, None, None]


def register(conn, worker: str, models: list[str], *, alive: bool, held: int = 0) -> None:
    for m in models:
        conn.hset(keys.MODELS, m, b"\x80")  # the reader needs only the names
    conn.sadd(keys.WORKERS, worker)
    conn.sadd(keys.worker_models(worker), *models)
    if alive:
        conn.set(keys.worker_heartbeat(worker), 1)
    for i in range(held):
        conn.sadd(keys.worker_jobs(worker), f"{worker}-job{i}")


def enqueue(conn, job_id: str, model: str, priority: int = 0, worker: str | None = None,
            tenant: str | None = None):
    with conn.pipeline() as pipe:
        pipe.multi()
        enqueue_new(conn, job_id, model, priority, pipe, worker=worker, tenant=tenant)
        pipe.execute()


def test_queues_workers_and_held_jobs_are_read_per_model(conn):
    register(conn, "w1", ["a", "b"], alive=True, held=2)
    register(conn, "w2", ["a"], alive=True, held=1)
    register(conn, "dead", ["a", "c"], alive=False, held=5)  # heartbeat expired, not reaped
    enqueue(conn, "j1", "a")
    enqueue(conn, "j2", "a", priority=5)
    enqueue(conn, "j3", "a", priority=-1)
    enqueue(conn, "j4", "b")
    enqueue(conn, "j5", "b", worker="w1")  # routed to w1's own queue
    enqueue(conn, "j6", "c", worker="dead")
    s = read_cluster_stats_sync(conn)
    assert s.queue_depth == {"a": 3, "b": 1, "c": 0}
    assert (s.routed, s.queued) == (2, 6)
    assert s.prefilling == 3  # the dead worker's 5 are not counted
    assert s.live_workers == {"a": 2, "b": 1, "c": 0}
    assert (s.workers_alive, s.workers_dead) == (2, 1)


class RoundTrips:
    """A redis connection that keeps the commands of each pipeline it executes, as
    ``(name, *args)``: what `read_cluster_stats_sync` sends, observed rather than re-driven."""

    def __init__(self, redis):
        self._redis, self.sent = redis, []

    def pipeline(self, **options):
        return RecordingPipeline(self._redis.pipeline(**options), self.sent)


class RecordingPipeline:
    def __init__(self, pipe, sent):
        self._pipe, self._sent, self._queued = pipe, sent, []

    def __enter__(self):
        self._pipe.__enter__()
        return self

    def __exit__(self, *exc):
        return self._pipe.__exit__(*exc)

    def __getattr__(self, name):
        command = getattr(self._pipe, name)

        def queue(*args):
            self._queued.append((name, *args))
            return command(*args)
        return queue

    def execute(self):
        self._sent.append(self._queued)
        self._queued = []
        return self._pipe.execute()


def read_with_round_trips(redis) -> tuple[stats.ClusterStats, list[list[tuple]]]:
    """`read_cluster_stats_sync(redis)`, and the commands of each of its round trips."""
    recorder = RoundTrips(redis)
    return read_cluster_stats_sync(recorder), recorder.sent


def test_the_read_is_two_round_trips_and_three_with_other_priorities(conn):
    assert len(read_with_round_trips(conn)[1]) == 1  # nothing registered: the counters only
    register(conn, "w1", ["a"], alive=True)
    enqueue(conn, "j1", "a")
    s, sent = read_with_round_trips(conn)
    assert len(sent) == 2 and s.queue_depth == {"a": 1}
    assert [len(r) for r in sent] == [5, 3 + 6]  # 3 per model, 6 per worker
    enqueue(conn, "j2", "a", priority=3)
    s, sent = read_with_round_trips(conn)
    assert sent[2] == [("llen", rq_queue_key(keys.intake_queue("a", 3)))]
    assert s.queue_depth == {"a": 2}
    enqueue(conn, "j3", "a", tenant="acme")  # a tenant's queue counts too
    s, sent = read_with_round_trips(conn)
    assert ("llen", rq_queue_key(keys.intake_queue("a", 0, "acme"))) in sent[2]
    assert s.queue_depth == {"a": 3}


def test_the_plan_decodes_canned_replies_without_redis():
    plan = read_plan()
    assert next(plan) == [("hgetall", keys.STATS), ("hkeys", keys.MODELS),
                          ("smembers", keys.WORKERS), ("hgetall", keys.TENANT_SERVICE),
                          ("hgetall", keys.TENANT_TOKENS)]
    raw = {b"submitted": b"7", b"finished": b"4", b"tokens_prefilled": b"100",
           b"chunk_le:0.01": b"3", b"chunk_le:+Inf": b"1", b"chunk_seconds_sum": b"12.5",
           b"chunk_le:0.003": b"9"}  # a bound no longer in use is ignored
    second = plan.send([raw, [b"m"], [b"w"], {b"acme": b"96.5", b"": b"10"},
                        {b"acme": b"193", b"": b"10"}])
    assert [c[0] for c in second] == ["smembers", "smembers", "llen", "exists", "smembers",
                                      "scard", "llen", "hget", "hgetall"]
    third = plan.send([set(), {b"0:acme"}, 4, 1, {b"m"}, 2, 1, b"4096", {b"acme": b"2"}])
    assert third == [("llen", rq_queue_key(keys.intake_queue("m", 0, "acme")))]
    with pytest.raises(StopIteration) as done:
        plan.send([3])
    s = done.value.value
    assert (s.submitted, s.finished, s.tokens_prefilled) == (7, 4, 100)
    assert (s.chunks.count, s.chunks.sum_seconds) == (4, 12.5)
    assert s.chunks.cumulative[:2] == (0, 3) and s.chunks.cumulative[-1] == 4
    assert (s.queue_depth, s.routed, s.prefilling, s.live_workers) == ({"m": 7}, 1, 2,
                                                                       {"m": 1})
    assert s.tenants == {"": stats.TenantStats(0, 0, 10, 10.0),
                         "acme": stats.TenantStats(3, 2, 193, 96.5)}
    assert s.service_spread == 0  # only acme has work now
    assert s.prefix_bytes == 4096  # the live worker's prefix cache
