"""`worker.faults`: the test-only fault plan parses strictly, is off unless
``PREFILLQ_FAULTS`` is set, and fires only for the jobs and attempts its rules select."""

from __future__ import annotations

import pytest

from worker.faults import FAULTS_ENV, FaultPlan, FaultRule


def test_no_plan_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert FaultPlan.from_env() is None
    monkeypatch.setenv(FAULTS_ENV, "  ")
    assert FaultPlan.from_env() is None
    monkeypatch.setenv(FAULTS_ENV, "raise_in_chunk:tokens=40")
    assert FaultPlan.from_env().rules == [FaultRule("raise_in_chunk", tokens=40)]


def test_rules_parse_every_key():
    plan = FaultPlan.parse("raise_in_chunk:job=j1:chunk=2:attempts=1,2; "
                           "pause_before_publish:tokens=7:seconds=1.5:until=/tmp/go")
    assert plan.rules == [
        FaultRule("raise_in_chunk", job="j1", chunk=2, attempts=frozenset({1, 2})),
        FaultRule("pause_before_publish", tokens=7, seconds=1.5, until="/tmp/go"),
    ]


@pytest.mark.parametrize("text", ["explode", "raise_in_chunk:chunk", "raise_in_chunk:chunk=x",
                                  "pause_before_start:color=red", "raise_in_chunk:attempts=1,a"])
def test_a_bad_plan_is_refused(text):
    with pytest.raises(ValueError, match=FAULTS_ENV):
        FaultPlan.parse(text)


def test_selectors_must_all_match():
    rule = FaultRule("raise_in_chunk", job="j1", tokens=40, attempts=frozenset({2}))
    assert rule.matches("j1", 40, 2)
    assert not rule.matches("j2", 40, 2)
    assert not rule.matches("j1", 41, 2)
    assert not rule.matches("j1", 40, 1)
    assert FaultRule("pause_before_start").matches("any", 1, 5)
