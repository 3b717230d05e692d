"""`SessionSlots`: a worker's kept session slots, LRU bounds and the holder keys in Redis."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jobs import keys
from worker.sessions import SessionSlots


@dataclass
class Slot:  # what SessionSlots reads of a slot: its size
    nbytes: int


def holder(conn, session: str) -> str | None:
    value = conn.get(keys.session_holder(session))
    return None if value is None else value.decode()


def test_kept_slots_name_this_worker_and_come_back_once(redis_conn):
    conn = redis_conn()
    slots = SessionSlots(conn, "w1")
    slot = Slot(10)
    assert slots.keep("s1", "m", slot) == []
    assert holder(conn, "s1") == "w1"
    assert 0 < conn.ttl(keys.session_holder("s1")) <= slots.ttl_s
    assert slots.take("s1", "m") is slot
    assert slots.take("s1", "m") is None  # checked out: not kept twice
    assert holder(conn, "s1") == "w1"  # its job runs here meanwhile


def test_the_least_recently_used_slot_goes_first(redis_conn):
    conn = redis_conn()
    slots = SessionSlots(conn, "w1", max_slots=2)
    slots.keep("a", "m", Slot(1))
    slots.keep("b", "m", Slot(1))
    slots.keep("a", "m", slots.take("a", "m"))  # a is used again: b is now the oldest
    assert slots.keep("c", "m", Slot(1)) == ["b"]
    assert "b" not in slots and holder(conn, "b") is None
    assert holder(conn, "a") == holder(conn, "c") == "w1"


def test_byte_bound_evicts_until_it_fits_and_refuses_a_slot_too_large(redis_conn):
    conn = redis_conn()
    slots = SessionSlots(conn, "w1", max_slots=8, max_bytes=100)
    slots.keep("a", "m", Slot(40))
    slots.keep("b", "m", Slot(40))
    assert slots.keep("c", "m", Slot(50)) == ["a"]
    assert slots.nbytes == 90
    assert slots.keep("big", "m", Slot(101)) == ["b", "c", "big"]
    assert len(slots) == 0 and holder(conn, "big") is None


def test_release_never_forgets_another_workers_holding(redis_conn):
    conn = redis_conn()
    mine, theirs = SessionSlots(conn, "w1"), SessionSlots(conn, "w2")
    mine.keep("s", "m", Slot(1))
    theirs.keep("s", "m", Slot(1))  # the session's last job ran on w2
    mine.release("s")
    assert holder(conn, "s") == "w2"
    mine.keep("t", "m", Slot(1))
    mine.release("t")
    assert holder(conn, "t") is None and "t" not in mine


def test_a_slot_of_another_model_is_dropped(redis_conn):
    slots = SessionSlots(redis_conn(), "w1")
    slots.keep("s", "gemma", Slot(1))
    assert slots.take("s", "deepseek") is None
    assert "s" not in slots


def test_zero_slots_keeps_nothing_and_bad_bounds_are_refused(redis_conn):
    conn = redis_conn()
    slots = SessionSlots(conn, "w1", max_slots=0)
    assert slots.keep("s", "m", Slot(1)) == ["s"]
    assert holder(conn, "s") is None
    with pytest.raises(ValueError):
        SessionSlots(conn, "w1", max_slots=-1)
    with pytest.raises(ValueError):
        SessionSlots(conn, "w1", max_bytes=-5)
