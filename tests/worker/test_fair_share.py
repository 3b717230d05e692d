"""Weighted fair share between tenants (`worker.fair_share`): the counters, a worker's steps
and admission order by them (`worker.scheduler`), their round trip through Redis
(`worker.roundtrip`) and the tenants' intake queues (`jobs.queues`); on fakeredis and real
prefills of the tiny Gemma 3 (the scheduler reads only their next chunk's size)."""

from __future__ import annotations

import fakeredis
import pytest

from jobs import keys
from jobs.queues import (
    AdmissionJob,
    enqueue_new,
    intake_depth,
    own_queue,
    requeue_to_intake,
    rq_queue_key,
)
from jobs.scripts import Scripts
from jobs.serializer import MsgpackSerializer
from worker.fair_share import FairShare, decode_weights, parse_weights, tenant_of
from worker.roundtrip import run_scripts
from worker.scheduler import Scheduler
from worker.taking import TakingQueue

from .helpers import MODEL
from .test_scheduler import resident, turns


def test_service_is_tokens_over_weight_and_the_least_served_goes_first():
    fair = FairShare({"gold": 4.0})
    fair.charge("gold", 400)
    fair.charge("", 150)
    assert fair.of("gold") == 100 and fair.of("") == 150 and fair.of("new") == 0
    assert fair.order(["", "gold", "new"]) == ["new", "gold", ""]
    assert fair.take_pending() == ({}, {"gold": 100, "": 150}, {"gold": 400, "": 150})
    assert fair.take_pending() == ({}, {}, {})
    untenanted = FairShare()  # no tenant seen: nothing goes to Redis
    untenanted.charge("", 10)
    assert untenanted.take_pending() == ({}, {}, {}) and untenanted.of("") == 10


def test_a_tenant_back_from_idle_is_lifted_to_the_least_backlogged_service():
    fair = FairShare()
    fair.seen("a")
    fair.charge("a", 1000)
    fair.charge("b", 600)
    fair.lift("late", ["a", "b"])  # VTC: no credit banked while it had nothing to run
    assert fair.of("late") == 600 and fair.take_pending()[0] == {"late": 600}
    fair.lift("a", ["b"])  # ahead already: unchanged
    assert fair.of("a") == 1000
    fair.lift("c", [])  # nobody backlogged: unchanged
    assert fair.of("c") == 0


def test_observe_is_the_clusters_service_plus_charges_not_yet_sent():
    fair = FairShare()
    fair.seen("a")
    fair.charge("a", 10)
    sent = fair.take_pending()
    fair.charge("a", 5)  # after the round trip's additions were taken
    fair.observe({b"a": b"110", b"b": b"7.5", b"junk": b"x"})
    assert fair.of("a") == 115 and fair.of("b") == 7.5 and fair.of("junk") == 0
    assert sent == ({}, {"a": 10}, {"a": 10})


def test_weights_parse_and_decode():
    assert parse_weights("a=2, b=0.5,") == {"a": 2.0, "b": 0.5}
    for bad in ("a", "=2", "a=0", "a=-1", "a=inf", "a=x"):
        with pytest.raises(ValueError, match="NAME=WEIGHT"):
            parse_weights(bad)
    assert decode_weights({b"a": b"2", b"b": b"0", b"c": b"nan", b"d": b"x"}) == {"a": 2.0}
    assert tenant_of(None) == "" and tenant_of("t") == "t"


def test_without_tenants_the_steps_are_the_round_robin_of_before(make, tiny):
    scheduler = make(max_batch_jobs=2)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16})
    assert turns(scheduler, 3) == [("a", "b"), ("c", "a"), ("b", "c")]


def test_a_flooding_tenant_does_not_hold_back_another_tenants_job(make, tiny):
    scheduler = make(max_batch_jobs=1)
    resident(scheduler, tiny, {f"f{i}": 16 for i in range(6)}, tenant="flood")
    for _ in range(5):  # the flood is served for a while
        scheduler.take_turn()
    resident(scheduler, tiny, {"s": 16}, tenant="short")  # lifted to the flood's service
    # round robin would give it a turn in 7 (f5, s, f0 .. f5, s); fair share alternates
    # (f5, admitted before it and not run yet, first: they tie)
    assert turns(scheduler, 6) == [("f5",), ("s",), ("f0",), ("s",), ("f1",), ("s",)]


def test_weighted_tenants_get_tokens_in_their_weights_ratio_within_a_step(make, tiny):
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    scheduler = make(max_batch_jobs=1, tenant_weights=weights)
    for tenant in weights:
        resident(scheduler, tiny, {f"{tenant}-{i}": 16 for i in range(4)}, n_tokens=256,
                 tenant=tenant)
    served = dict.fromkeys(weights, 0)
    for _ in range(70):
        step = scheduler.take_turn()
        for active in step.jobs:
            served[active.tenant] += 16
        # the contract: backlogged tenants' weighted service within a step's tokens
        weighted = [served[t] / w for t, w in weights.items()]
        assert max(weighted) - min(weighted) <= 16
    assert served == {"w1": 160, "w2": 320, "w4": 640}


def test_admission_takes_the_least_served_tenant_first_its_priorities_in_order(make):
    scheduler = make(tenant_weights={"gold": 2.0})
    conn = scheduler.connection
    for i, tenant in enumerate(["gold", "bronze", None]):
        with conn.pipeline() as pipe:
            enqueue_new(conn, f"j{i}", MODEL, 0, pipe, tenant=tenant)
            pipe.execute()
    with conn.pipeline() as pipe:
        enqueue_new(conn, "urgent", MODEL, 5, pipe, tenant="bronze")
        pipe.execute()
    scheduler.fair.charge("gold", 300)  # 150 weighted
    scheduler.fair.charge("bronze", 200)
    scheduler.fair.charge("", 100)
    names = [q.name for q in scheduler.queues()]
    # priorities order a tenant's own jobs; a tenant's high priority does not jump others
    assert names == ["prefill:w:w1", keys.intake_queue(MODEL), keys.intake_queue(MODEL, 0, "gold"),
                     keys.intake_queue(MODEL, 5, "bronze"), keys.intake_queue(MODEL, 0, "bronze")]
    conn.hset(keys.TENANT_WEIGHTS, "bronze", "4")  # an operator's edit, read with the levels
    scheduler.idle_queues()
    assert scheduler.fair.weight("bronze") == 4.0
    assert intake_depth(conn, MODEL) == 4


def test_a_requeued_job_goes_back_to_its_tenants_queue():
    conn = fakeredis.FakeStrictRedis()
    conn.hset(keys.job("j1"), mapping={"model": MODEL, "priority": 2, "tenant": "acme"})
    requeue_to_intake(conn, "j1")
    assert conn.llen(rq_queue_key(keys.intake_queue(MODEL, 2, "acme"))) == 1
    assert conn.smembers(keys.tenant_levels(MODEL)) == set()  # listed at submit already


def test_a_step_round_trip_adds_the_charges_and_reads_the_clusters_service():
    conn = fakeredis.FakeStrictRedis()
    conn.hset(keys.TENANT_SERVICE, "a", 100)  # another worker's charges
    scheduler = Scheduler(conn, [MODEL], own_queue(conn, "w1"), tenant_weights={"b": 2.0})
    scheduler.fair.charge("a", 10)
    scheduler.fair.charge("b", 10)
    reply = run_scripts(conn, Scripts(conn), [], scheduler.probe([]))
    scheduler.saw(reply)
    assert scheduler.fair.of("a") == 110 and scheduler.fair.of("b") == 5
    assert float(conn.hget(keys.TENANT_SERVICE, "b")) == 5
    assert scheduler.fair.pending == {}


def test_a_tenant_with_nothing_resident_takes_one_slot_beyond_max_active(make, tiny):
    scheduler = make(max_active=2)
    conn = scheduler.connection
    resident(scheduler, tiny, {"f0": 16, "f1": 16}, tenant="flood")
    for job_id, tenant in (("f2", "flood"), ("s0", "short"), ("n0", None)):
        with conn.pipeline() as pipe:
            enqueue_new(conn, job_id, MODEL, 0, pipe, tenant=tenant)
            pipe.execute()
    assert not scheduler.admitting() and scheduler.room() == 1
    # full: only the queues of tenants with no job here (the flood's own is not among them)
    assert [q.name for q in scheduler.queues()] == [keys.intake_queue(MODEL),
                                                   keys.intake_queue(MODEL, 0, "short")]
    resident(scheduler, tiny, {"s0": 16}, tenant="short")
    resident(scheduler, tiny, {"n0": 16})
    assert scheduler.queues() == [] and scheduler.room() == 0  # every tenant holds a slot
    resident(scheduler, tiny, {"x": 16}, tenant="x")  # 5 resident; a 4th tenant would pass 4
    assert not scheduler.extra_slot()


def test_without_tenants_a_full_worker_admits_nothing(make, tiny):
    scheduler = make(max_active=2)
    resident(scheduler, tiny, {"a": 16, "b": 16})
    assert scheduler.queues() == [] and scheduler.room() == 0 and not scheduler.extra_slot()


def test_a_tenant_at_its_resident_quota_is_not_admitted_and_takes_are_capped(make, tiny):
    scheduler = make(max_active=8, tenant_max_resident=2)
    conn = scheduler.connection
    resident(scheduler, tiny, {"a0": 16, "a1": 16}, tenant="a")
    resident(scheduler, tiny, {"b0": 16}, tenant="b")
    for i in range(3):
        for tenant in ("a", "b", "c"):
            with conn.pipeline() as pipe:
                enqueue_new(conn, f"{tenant}{i + 3}", MODEL, 0, pipe, tenant=tenant)
                pipe.execute()
    admit = scheduler.admission()
    queues, caps = admit.queues, admit.caps
    # a is at its quota; the rest least served first, equals by name ("" the untenanted)
    assert [q.name for q in queues[1:]] == [keys.intake_queue(MODEL),
                                           keys.intake_queue(MODEL, 0, "b"),
                                           keys.intake_queue(MODEL, 0, "c")]
    assert caps == [5, 2, 1, 2]  # the own queue: the room; "": 2 - 0; b: 2 - 1; c: 2 - 0
    taking = TakingQueue.for_worker("w1", conn)
    popped = taking.take(queues, scheduler.room(), conn, AdmissionJob, MsgpackSerializer, 60,
                         caps=caps)
    assert sorted(job.args[0] for job, _ in popped) == ["b3", "c3", "c4"]


def test_two_workers_lifting_one_tenant_at_once_lift_it_once():
    conn = fakeredis.FakeStrictRedis()
    conn.hset(keys.TENANT_SERVICE, "flood", 1000)
    workers = [Scheduler(conn, [MODEL], own_queue(conn, f"w{i}")) for i in range(2)]
    for scheduler in workers:
        scheduler.fair.seen("new")
        scheduler.fair.observe(conn.hgetall(keys.TENANT_SERVICE))
        scheduler.fair.lift("new", ["flood"])
        scheduler.fair.charge("new", 10)  # its first chunk here
        assert scheduler.fair.of("new") == 1010
    for scheduler in workers:  # both round trips: the floor is a max, the charges add
        scheduler.saw(run_scripts(conn, Scripts(conn), [], scheduler.probe([])))
    assert float(conn.hget(keys.TENANT_SERVICE, "new")) == 1020  # not 2,020
    assert workers[1].fair.of("new") == 1020
