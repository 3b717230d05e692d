"""`worker.connection.ShutdownRetry`: an outage is retried and said once, not silently."""

from __future__ import annotations

import logging

from redis.exceptions import ConnectionError, ResponseError

from worker.connection import ShutdownRetry


def flaky(failures: int, error: Exception):
    calls = []

    def do():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "done"
    return do, calls


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    do, calls = flaky(3, ConnectionError("Error 111 connecting to localhost:6399."))
    with caplog.at_level(logging.INFO, logger="prefillq.worker"):
        assert ShutdownRetry().call_with_retry(do, lambda error: None) == "done"
    assert len(calls) == 4
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("WARNING", "Redis is unreachable (Error 111 connecting to "
                                   "localhost:6399.); retrying until it answers")
    assert len(lines) == 2 and lines[1][0] == "INFO"
    assert lines[1][1].startswith("Redis answered again after ")
    assert lines[1][1].endswith(" s (3 failed attempts)")


def test_a_refused_write_is_left_to_its_caller_to_log(caplog):
    do, _ = flaky(1, ResponseError("OOM command not allowed"))
    retry = ShutdownRetry(errors=(ResponseError,))
    with caplog.at_level(logging.INFO, logger="prefillq.worker"):
        assert retry.call_with_retry(do, lambda error: None) == "done"
    assert not caplog.records


def test_a_call_that_never_fails_logs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="prefillq.worker"):
        assert ShutdownRetry().call_with_retry(lambda: 7, lambda error: None) == 7
    assert not caplog.records


