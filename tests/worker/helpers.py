"""Shared by the worker tests: token ids of the tiny Gemma 3, the chunk-line hook, checks."""

from __future__ import annotations

import logging
import re

import numpy as np
import redis

MODEL = "gemma3-tiny"
CHUNK = 16
CHUNK_LINE = re.compile(r"job (\w+) chunk (\d+): (\d+)/(\d+) tokens")


def ids(n: int, seed: int) -> list[int]:
    """`n` token ids: BOS then random ids of the tiny vocabulary's text tokens."""
    rng = np.random.default_rng(seed)
    return [2, *rng.integers(260, 365, size=n - 1).tolist()]


class OnChunk(logging.Handler):
    """Records the job and cursor of every chunk, in order, and runs
    `action(job_id, chunk_no)` after it."""

    def __init__(self, action=None):
        super().__init__(logging.INFO)
        self.order: list[str] = []
        self.cursors: list[tuple[str, int]] = []
        self.action = action

    def emit(self, record: logging.LogRecord) -> None:
        m = CHUNK_LINE.match(record.getMessage())
        if m:
            self.order.append(m.group(1))
            self.cursors.append((m.group(1), int(m.group(3))))
            if self.action is not None:
                self.action(m.group(1), int(m.group(2)))


def assert_logits_match(result, tiny, token_ids):
    expected = tiny.start_prefill(token_ids).run()
    top = np.argsort(-expected)[: len(result.top_k)]
    assert [t.id for t in result.top_k] == top.tolist()
    for t in result.top_k:
        assert abs(t.logit - expected[t.id]) <= 1e-3 * np.abs(expected).max()


class CountingConnection(redis.Connection):
    """redis-py's connection, counting the requests it sends (`sent`): one per command, one
    per pipeline (its commands go out together: one round trip)."""

    sent = 0

    def send_packed_command(self, command, check_health=True):
        CountingConnection.sent += 1
        return super().send_packed_command(command, check_health)
