"""`worker.scheduler.Scheduler`'s steps: turn order, `max_batch_jobs` and `step_tokens`, on
real prefills of the tiny Gemma 3 (the scheduler reads only their next chunk's size)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from model.planner import plan_chunks
from worker.scheduler import Admit, Idle, Run, Scheduler

from .helpers import ids


def resident(scheduler: Scheduler, tiny, chunks: dict[str, int], n_tokens: int = 64,
             tenant: str | None = None) -> None:
    """Make jobs named by `chunks` resident, each planned in chunks of that many tokens, of
    `tenant`."""
    for name, chunk in chunks.items():
        plan = plan_chunks(n_tokens, tiny.sliding_window, chunk_tokens=chunk)
        prefill = tiny.start_prefill(ids(n_tokens, len(name)), plan=plan)
        scheduler.add(SimpleNamespace(job_id=name, prefill=prefill, tenant=tenant))


def turns(scheduler: Scheduler, n: int) -> list[tuple[str, ...]]:
    return [tuple(a.job_id for a in scheduler.take_turn().jobs) for _ in range(n)]


def test_one_job_per_step_is_round_robin(make, tiny):
    scheduler = make(max_batch_jobs=1)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16})
    assert turns(scheduler, 4) == [("a",), ("b",), ("c",), ("a",)]


def test_a_step_takes_up_to_max_batch_jobs_in_turn_order(make, tiny):
    scheduler = make(max_batch_jobs=2)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16})
    steps = turns(scheduler, 3)
    assert steps == [("a", "b"), ("c", "a"), ("b", "c")]
    # every job runs within ceil(3 / 2) = 2 steps of its last turn
    for job in "abc":
        at = [i for i, step in enumerate(steps) if job in step]
        assert max(b - a for a, b in zip(at, at[1:], strict=False)) <= 2


def test_step_tokens_bounds_a_step_but_never_empties_it(make, tiny):
    scheduler = make(max_batch_jobs=8, step_tokens=40)
    resident(scheduler, tiny, {"a": 16, "b": 16, "big": 64, "c": 16})
    step = scheduler.take_turn()
    assert [a.job_id for a in step.jobs] == ["a", "b"] and step.tokens == 32  # + 64 > 40
    assert [a.job_id for a in scheduler.take_turn().jobs] == ["big"]  # alone, over the cap
    assert [a.job_id for a in scheduler.take_turn().jobs] == ["c", "a"]


def test_next_step_does_not_take_the_turn(make, tiny):
    scheduler = make(max_batch_jobs=2)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16})
    assert [a.job_id for a in scheduler.next_step().jobs] == ["a", "b"]
    assert [a.job_id for a in scheduler.take_turn().jobs] == ["a", "b"]
    assert [a.job_id for a in scheduler.next_step().jobs] == ["c", "a"]


def test_schedule_admits_when_a_job_waits_else_runs_else_idles(make, tiny):
    scheduler = make()
    assert isinstance(scheduler.schedule(), Admit)  # a look first, even with none resident
    scheduler.saw_intake(False)
    assert isinstance(scheduler.schedule(), Idle)
    resident(scheduler, tiny, {"a": 16})
    scheduler.saw_intake(True)
    decision = scheduler.schedule()
    assert isinstance(decision, Admit) and decision.queues[0] == scheduler.own
    assert isinstance(scheduler.schedule(), Admit)  # admitting goes on while one waits
    scheduler.saw_intake(False)  # an admission's look found none
    decision = scheduler.schedule()
    assert isinstance(decision, Run) and [a.job_id for a in decision.step.jobs] == ["a"]
    with pytest.raises(LookupError):
        make().take_turn()


def test_nothing_is_admitted_past_max_active(make, tiny):
    scheduler = make(max_active=2)
    resident(scheduler, tiny, {"a": 16, "b": 16})
    scheduler.saw_intake(True)
    assert isinstance(scheduler.schedule(), Run)


def test_admitted_jobs_share_their_first_step_before_the_jobs_that_ran(make, tiny):
    scheduler = make(max_batch_jobs=2)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16})
    assert turns(scheduler, 1) == [("a", "b")]
    resident(scheduler, tiny, {"d": 16})  # after c, admitted before it and not stepped yet
    assert turns(scheduler, 1) == [("c", "d")]
    resident(scheduler, tiny, {"new": 16, "newer": 16})  # admitted in this order
    assert turns(scheduler, 3) == [("new", "newer"), ("a", "b"), ("c", "d")]


def test_a_job_whose_last_chunk_ran_takes_no_turn(make, tiny):
    scheduler = make(max_batch_jobs=2)
    resident(scheduler, tiny, {"a": 16, "b": 16, "c": 16}, n_tokens=16)
    for active in scheduler.take_turn().jobs:
        active.prefill.run()
    assert [a.job_id for a in scheduler.next_step().jobs] == ["c"]
    scheduler.take_turn().jobs[0].prefill.run()
    scheduler.saw_intake(False)
    assert scheduler.next_step() is None and isinstance(scheduler.schedule(), Idle)


def test_a_bad_step_tokens_is_refused(make):
    with pytest.raises(ValueError, match="step_tokens"):
        make(step_tokens=0)
