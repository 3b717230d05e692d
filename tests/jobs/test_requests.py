"""Submit validation shared by the clients and the worker (`jobs.requests`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import EmptyPrompt, InvalidRequest, Limits, PromptTooLarge, PromptTooLong, TokenOutOfRange
from jobs.requests import check_record, check_token_ids, new_record
from jobs.schema import LogitsMode

ARGS = dict(prompt=None, tokens=None, messages=None, model="m", top_k=5, logits="top_k",
            parse_special=True, session=None, priority=0, chunk_tokens=None,
            idempotency_key=None, max_attempts=3, enqueued_at=1.0)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""}]


SUBMIT_KEYWORDS = ("prompt", "tokens", "messages", "add_generation_prompt", "model", "top_k",
                   "logits", "parse_special", "session", "priority", "prompt_logprobs",
                   "chunk_tokens", "idempotency_key", "max_attempts")


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


# -- every keyword, any value: a record or an InvalidRequest naming the field --------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                 st.text(max_size=8), st.binary(max_size=4), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                 st.tuples(st.integers()), st.characters(categories=["Cs"]))
VALID = dict(ARGS, prompt="hello")
# submit keyword -> the record field it becomes
RECORD_FIELD = {"logits": "logits_mode"}


@settings(max_examples=50, deadline=None)
@given(field=st.sampled_from([f for f in SUBMIT_KEYWORDS if f != "prompt"] + ["prompt"]),
       value=JUNK)
def test_any_value_of_any_keyword_is_kept_or_refused_naming_the_field(field, value):
    changes = {field: value}
    if field in ("tokens", "messages"):
        changes["prompt"] = None  # one input at a time
    try:
        r = record(**{**VALID, **changes})
    except InvalidRequest as e:
        message = str(e)
        named = (field, "give exactly one of") if field in ("prompt", "tokens", "messages") \
            else (field,)
        assert message.startswith(named), message
        return
    kept = getattr(r, RECORD_FIELD.get(field, field))
    if field == "logits":
        assert kept == LogitsMode(value)
    elif field == "tokens":
        assert kept == [int(t) for t in value] and all(type(t) is int for t in kept)
    elif field == "messages":
        assert kept == list(value)
    else:
        assert kept == value and type(kept) is type(value)  # never coerced


@pytest.mark.parametrize("field, value, match", [
    ("tokens", ["a"], r"^tokens\[0\] must be an integer, got str 'a'$"),
    ("tokens", {"a": 1}, r"^tokens must be a list of integer token ids, got dict$"),
    ("tokens", [1.5], r"^tokens\[0\] must be an integer, got float 1.5$"),
    ("tokens", [2, False], r"^tokens\[1\] must be an integer, got bool False$"),
    ("tokens", "abc", "^tokens must be a list"), ("tokens", 5, "^tokens must be a list"),
    ("tokens", {1, 2}, "^tokens must be a list"), ("tokens", [None], r"^tokens\[0\]"),
    ("top_k", "x", "^top_k must be an integer, got str 'x'$"),
    ("top_k", "3", "^top_k must be an integer"), ("top_k", 2.5, "^top_k must be an integer"),
    ("top_k", True, "^top_k must be an integer, got bool True$"),
    ("top_k", 10**30, r"^top_k must be in \[0, 1000\]"),
    ("chunk_tokens", "big", "^chunk_tokens must be an integer"),
    ("chunk_tokens", 2**40, r"^chunk_tokens must be in \[1, 2147483647\]"),
    ("priority", "high", "^priority must be an integer, got str 'high'$"),
    ("priority", 10**30, r"^priority must be in \[-1000, 1000\]"),
    ("max_attempts", "x", "^max_attempts must be an integer"),
    ("max_attempts", 10**6, r"^max_attempts must be in \[1, 100\]"),
    ("model", 5, "^model must be a non-empty string, got 5$"),
    ("model", "", "^model must be a non-empty string"),
    ("model", "\udcff", "^model is not valid text"),
    ("session", 5, "^session must be a non-empty string"),
    ("session", "", "^session must be a non-empty string"),
    ("session", "s" * 1025, "^session is over 1024 bytes$"),
    ("tenant", "", "^tenant must be a non-empty string"),
    ("tenant", 7, "^tenant must be a non-empty string"),
    ("tenant", "t" * 1025, "^tenant is over 1024 bytes$"),
    ("idempotency_key", b"k", "^idempotency_key must be a non-empty string"),
    ("idempotency_key", "", "^idempotency_key must be a non-empty string"),
    ("parse_special", "no", "^parse_special must be True or False, got 'no'$"),
    ("parse_special", 1, "^parse_special must be True or False"),
    ("add_generation_prompt", None, "^add_generation_prompt must be True or False"),
    ("prompt", 5, "^prompt must be a string, got int$"),
    ("prompt", b"abc", "^prompt must be a string, got bytes$"),
    ("prompt", "\ud800abc", r"^prompt is not valid text: '\\ud800' at index 0 is a lone "
                            "surrogate, which UTF-8 cannot encode$"),
    ("logits", ["x"], "^logits must be none, top_k or full"),
    ("prompt_logprobs", "3", "^prompt_logprobs must be an integer"),
    ("prompt_logprobs", 21, r"^prompt_logprobs must be in \[0, 20\], got 21$"),
])
def test_each_bad_value_names_its_field(field, value, match):
    changes = {field: value, "prompt": None} if field == "tokens" else {field: value}
    with pytest.raises(InvalidRequest, match=match):
        record(**{**VALID, **changes})


def test_a_lone_surrogate_in_messages_names_the_message():
    for bad, where in (([{"role": "user", "content": "a\ud800"}], r"messages\[0\].content"),
                       ([*CHAT, {"role": "us\udfffer", "content": "a"}], r"messages\[3\].role")):
        with pytest.raises(InvalidRequest, match=f"^{where} is not valid text"):
            record(messages=bad)


def test_numpy_integers_and_integer_arrays_are_ints():
    r = record(tokens=np.array([2, 5, 7], dtype=np.int64), top_k=np.int32(4),
               priority=np.int8(-2), chunk_tokens=np.uint16(8))
    assert r.tokens == [2, 5, 7] and all(type(t) is int for t in r.tokens)
    assert (r.top_k, r.priority, r.chunk_tokens) == (4, -2, 8)
    assert record(tokens=[np.int64(2), 3]).tokens == [2, 3]
    assert record(tokens=range(2, 5)).tokens == [2, 3, 4]
    for floats in (np.array([2.0, 3.0]), [np.float32(2.0)], np.array([True, False])):
        with pytest.raises(InvalidRequest, match=r"^tokens\[0\] must be an integer"):
            record(tokens=floats)
    with pytest.raises(InvalidRequest, match="^top_k must be an integer, got bool"):
        record(prompt="a", top_k=np.True_)


def test_check_record_refuses_what_new_record_refuses():
    good = record(tokens=[2, 5])
    check_record(good)
    for change, match in (({"prompt": "x"}, "give exactly one of"), ({"top_k": -1}, "top_k"),
                          ({"tokens": []}, "tokens is empty"),
                          ({"session": "s", "prompt_logprobs": 2}, "session"),
                          ({"chunk_tokens": 0}, "chunk_tokens")):
        with pytest.raises(InvalidRequest, match=match):
            check_record(dataclasses.replace(good, **change))
    with pytest.raises(PromptTooLarge):
        check_record(dataclasses.replace(good, tokens=None, prompt="x" * 11),
                     Limits(max_prompt_bytes=10))
