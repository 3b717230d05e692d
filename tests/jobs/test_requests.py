"""Submit validation shared by the clients and the worker (`jobs.requests`)."""

from __future__ import annotations

import pytest

from jobs import EmptyPrompt, InvalidRequest, PromptTooLong, TokenOutOfRange
from jobs.requests import check_token_ids, new_record

ARGS = dict(prompt=None, tokens=None, messages=None, model="m", top_k=5, logits="top_k",
            parse_special=True, session=None, priority=0, chunk_tokens=None,
            idempotency_key=None, max_attempts=3, enqueued_at=1.0)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""}]


def record(**changes):
    return new_record("j", **{**ARGS, **changes})


def test_a_valid_request_builds_a_queued_record():
    r = record(tokens=(2, 5), chunk_tokens=16, priority=2)
    assert r.tokens == [2, 5] and r.chunk_tokens == 16 and r.priority == 2
    assert r.state == "queued" and r.cursor == 0 and r.attempts == 0


def test_numeric_strings_are_refused_not_parsed():
    # integers are ints: "16" is a caller's bug, as 2.5 is, never parsed or rounded
    for field in ("chunk_tokens", "priority", "top_k", "max_attempts"):
        with pytest.raises(InvalidRequest, match=f"^{field} must be an integer, got str '3'"):
            record(prompt="a", **{field: "3"})


@pytest.mark.parametrize("changes", [
    {}, {"prompt": "a", "tokens": [1]}, {"prompt": "   \n"}, {"tokens": []},
    {"prompt": "a", "top_k": -1}, {"prompt": "a", "top_k": 1001}, {"prompt": "a", "logits": "x"},
    {"prompt": "a", "chunk_tokens": 0}, {"prompt": "a", "max_attempts": 0},
    {"prompt": "a", "messages": CHAT}, {"tokens": [1], "messages": CHAT},
])
def test_bad_requests_are_invalid(changes):
    with pytest.raises(InvalidRequest):
        record(**changes)



def test_messages_are_checked_and_stored_with_the_generation_flag():
    r = record(messages=tuple(CHAT), add_generation_prompt=False)
    assert r.messages == CHAT and r.messages[0] is not CHAT[0]  # copies, in order
    assert r.add_generation_prompt is False and r.prompt is None and r.tokens is None
    assert record(messages=CHAT).add_generation_prompt is True


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("Hi", "non-empty list"),
    ({"role": "user", "content": "Hi"}, "non-empty list"),
    (["Hi"], r"messages\[0\] must be a dict with keys role and content, got str"),
    ([{"role": "user"}], r"messages\[0\] must be a dict .* got \['role'\]"),
    ([{"role": "user", "content": "a", "name": "x"}], r"got \['content', 'name', 'role'\]"),
    ([*CHAT, {"role": 1, "content": "a"}], r"messages\[3\]: role must be a non-empty string"),
    ([{"role": "", "content": "a"}], "role must be a non-empty string"),
    ([{"role": "user", "content": None}], "content a string, got str and NoneType"),
    ([{"role": "user", "content": ["a"]}], "got str and list"),
])
def test_malformed_messages_are_invalid(messages, match):
    with pytest.raises(InvalidRequest, match=match):
        record(messages=messages)


def test_add_generation_prompt_must_be_a_bool():
    with pytest.raises(InvalidRequest, match="add_generation_prompt must be True or False"):
        record(messages=CHAT, add_generation_prompt="no")


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
