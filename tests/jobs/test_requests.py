"""Submit validation shared by the clients and the worker (`jobs.requests`)."""

from __future__ import annotations

import pytest

from jobs import EmptyPrompt, InvalidRequest, PromptTooLong, TokenOutOfRange
from jobs.requests import check_token_ids, new_record

ARGS = dict(prompt=None, tokens=None, messages=None, model="m", top_k=5, logits="top_k",
            parse_special=True, session=None, priority=0, chunk_tokens=None,
            idempotency_key=None, max_attempts=3, enqueued_at=1.0)


def record(**changes):
    return new_record("j", **{**ARGS, **changes})


def test_a_valid_request_builds_a_queued_record():
    r = record(tokens=[2, 5], chunk_tokens="16", priority="2")
    assert r.tokens == [2, 5] and r.chunk_tokens == 16 and r.priority == 2
    assert r.state == "queued" and r.cursor == 0 and r.attempts == 0


@pytest.mark.parametrize("changes", [
    {}, {"prompt": "a", "tokens": [1]}, {"prompt": "   \n"}, {"tokens": []},
    {"prompt": "a", "top_k": -1}, {"prompt": "a", "top_k": 1001}, {"prompt": "a", "logits": "x"},
    {"prompt": "a", "chunk_tokens": 0}, {"prompt": "a", "max_attempts": 0},
    {"messages": [{"role": "user", "content": "hi"}]},
])
def test_bad_requests_are_invalid(changes):
    with pytest.raises(InvalidRequest):
        record(**changes)


def test_token_ids_are_checked_against_the_model():
    check_token_ids([0, 99], vocab_size=100, context_length=2)  # the edges are fine
    with pytest.raises(EmptyPrompt):
        check_token_ids([], vocab_size=100, context_length=2)
    for bad in (100, -1):
        with pytest.raises(TokenOutOfRange):
            check_token_ids([1, bad], vocab_size=100, context_length=8)
    with pytest.raises(PromptTooLong):
        check_token_ids([1, 2, 3], vocab_size=100, context_length=2)
    for error in (EmptyPrompt, TokenOutOfRange, PromptTooLong):
        assert issubclass(error, InvalidRequest) and issubclass(error, ValueError)
