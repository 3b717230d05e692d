"""Everything a client can send to `submit`, as properties (hypothesis), through a real client
and a real in-process worker on the tiny Gemma 3 served with a 64-token context, against
fakeredis and a real redis-server.

Each request either is refused at `submit` with a documented typed error (an
`InvalidRequest` naming its field, or a subclass) and writes nothing, or is accepted and ends
``finished`` (with the logits of a fresh prefill of its tokens) or ``failed`` with a
documented input error. The worker survives every batch, and a good job submitted alongside
finishes with the right logits.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jobs import (
    InvalidRequest,
    JobState,
    PrefillQError,
    PromptTooLarge,
    PromptTooLong,
    TokenOutOfRange,
    UnknownModel,
    keys,
)
from jobs.queues import intake_queue
from jobs.record import JobRecord

from .helpers import (
    CONTEXT,
    FIELDS,
    JOB_INPUT_ERRORS,
    MODEL,
    SUBMIT_ERRORS,
    VOCAB,
    assert_good,
    assert_logits,
    ids,
    submit_good,
    work,
)

SURROGATE = st.characters(categories=["Cs"])
WITH_SURROGATE = st.tuples(st.text(max_size=4), SURROGATE, st.text(max_size=4)).map("".join)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                 st.text(max_size=6), st.binary(max_size=4), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
# well-formed inputs, from blank to one token over the context
INPUTS = st.one_of(
    st.builds(dict, prompt=st.one_of(
        st.text(alphabet=" \t\n\r\x0b\x0c", max_size=4),  # blank: refused
        st.sampled_from(["<bos>", "<bos><bos>", "<eos>", "\x00"]),  # BOS only, specials
        st.integers(CONTEXT - 4, CONTEXT + 2).map(lambda k: "a" * k),  # k + 1 tokens
        st.text(min_size=1, max_size=30))),  # any Unicode text
    st.builds(dict, tokens=st.one_of(
        st.integers(1, CONTEXT + 1).map(lambda n: ids(n, n)),
        st.builds(lambda n: np.arange(2, 2 + n, dtype=np.int32), st.integers(1, 8)))),
    st.builds(dict, messages=st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=8)}),
        min_size=1, max_size=2)),
)
OPTIONS = st.fixed_dictionaries({"model": st.just(MODEL)}, optional={
    "top_k": st.integers(0, 50), "logits": st.sampled_from(["none", "top_k", "full"]),
    "chunk_tokens": st.integers(1, 80), "priority": st.integers(-3, 3),
    "max_attempts": st.integers(1, 5), "parse_special": st.booleans(),
    "add_generation_prompt": st.booleans(), "session": st.sampled_from(["s1", "s2"]),
    "idempotency_key": st.text(min_size=1, max_size=8), "prompt_logprobs": st.integers(0, 5),
})
# a bad value for each field (any junk, or just out of its range)
BAD = {
    "prompt": st.one_of(WITH_SURROGATE, st.binary(max_size=4), st.integers(), JUNK),
    "tokens": st.one_of(
        st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, 2**70),
                           st.integers(-(2**70), -1), st.floats(), st.booleans(),
                           st.text(max_size=2), st.none()), min_size=1, max_size=6),
        st.just([]), st.integers(CONTEXT + 1, CONTEXT + 3).map(lambda n: ids(n, 1)), JUNK),
    "messages": st.one_of(st.builds(lambda c: [{"role": "user", "content": c}], WITH_SURROGATE),
                          st.lists(JUNK, max_size=2), JUNK),
    "model": st.one_of(st.sampled_from(["nope", "", "gemma3-270m"]), JUNK),
    "top_k": st.one_of(st.integers(-5, -1), st.integers(1001, 10**30), JUNK),
    "logits": st.one_of(st.sampled_from(["TOP_K", "all", ""]), JUNK),
    "chunk_tokens": st.one_of(st.integers(-3, 0), JUNK),
    "priority": st.one_of(st.integers(1001, 10**20), JUNK),
    "max_attempts": st.one_of(st.integers(-2, 0), st.integers(101, 10**9), JUNK),
    "prompt_logprobs": st.one_of(st.integers(-3, -1), st.integers(21, 10**6), JUNK),
    "parse_special": JUNK, "add_generation_prompt": JUNK,
    "session": st.one_of(st.just(""), st.just("s" * 2000), WITH_SURROGATE, JUNK),
    "idempotency_key": st.one_of(st.just(""), WITH_SURROGATE, JUNK),
    "tenant": st.one_of(st.just(""), WITH_SURROGATE, JUNK),
}
MUTATION = st.sampled_from(sorted(BAD)).flatmap(lambda f: BAD[f].map(lambda v: (f, v)))
REQUESTS = st.builds(lambda i, o, bad: {**o, **i, **dict(bad)}, INPUTS, OPTIONS,
                     st.lists(MUTATION, max_size=2))
MODEST = settings(max_examples=25, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_documented_refusal(error: Exception) -> None:
    assert isinstance(error, SUBMIT_ERRORS), f"{type(error).__name__}: {error}"
    if type(error) is InvalidRequest:
        assert str(error).startswith(FIELDS), str(error)


def expected_ids(tiny, request: dict) -> list[int] | None:
    """The token ids an accepted request prefills (None: messages, which this model's GGUF
    has no template for)."""
    if request.get("tokens") is not None:
        return [int(t) for t in request["tokens"]]
    if request.get("prompt") is not None:
        return tiny.tokenizer.encode(request["prompt"],
                                     parse_special=request.get("parse_special", True))
    return None


def check_accepted(client, tiny, job_id: str, request: dict) -> None:
    status = client.status(job_id)
    assert status.state.is_terminal, status
    event(f"accepted: {status.state.value} {(status.error or {}).get('type', '')}")
    want = expected_ids(tiny, request)
    if status.state == JobState.FAILED:
        assert status.error["type"] in JOB_INPUT_ERRORS, status.error
        if want is None:
            assert status.error["type"] == "ChatTemplateMissing"
        else:  # only text can be over the context here: ids over it are refused at submit
            assert status.error["type"] == "PromptTooLong" and len(want) > CONTEXT
        return
    assert status.state == JobState.FINISHED and len(want) <= CONTEXT
    assert status.n_tokens == len(want)
    if request.get("top_k", 20) > 0:
        assert_logits(client.result(job_id, timeout=0), tiny, want)


@MODEST
@given(requests=st.lists(REQUESTS, min_size=1, max_size=3))
def test_every_request_is_refused_typed_or_ends_typed(stack, tiny64, requests):
    worker, client = stack()
    client.redis.flushall()
    worker.register_models()
    accepted, by_key = [], {}
    for request in requests:
        before = client.redis.dbsize()
        try:
            job_id = client.submit(**request)
        except PrefillQError as error:
            event(f"refused: {type(error).__name__}")
            assert_documented_refusal(error)
            assert client.redis.dbsize() == before  # nothing was written
            continue
        key = request.get("idempotency_key")
        if key is not None and key in by_key:  # the same key: the same job, whatever asked
            assert job_id == by_key[key]
            continue
        by_key[key] = job_id
        accepted.append((job_id, request))
    good = submit_good(client)
    work(worker)
    assert not worker.active
    for job_id, request in accepted:
        check_accepted(client, tiny64, job_id, request)
    assert_good(client, good, tiny64)


@pytest.mark.parametrize("n, outcome", [
    (CONTEXT - 1, "finished"), (CONTEXT, "finished"), (CONTEXT + 1, PromptTooLong)])
def test_token_prompts_at_the_edge_of_the_context(stack, tiny64, n, outcome):
    worker, client = stack()
    token_ids = ids(n, 3)
    if outcome is PromptTooLong:
        with pytest.raises(PromptTooLong, match=f"{n} tokens, more than the limit of {CONTEXT}"):
            client.submit(tokens=token_ids, model=MODEL)
        return
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    work(worker)
    assert_logits(client.result(job, timeout=0), tiny64, token_ids)


@pytest.mark.parametrize("k", [CONTEXT - 2, CONTEXT - 1, CONTEXT])  # k + 1 tokens with BOS
def test_text_prompts_at_the_edge_of_the_context(stack, tiny64, k):
    worker, client = stack()
    assert len(tiny64.tokenizer.encode("a" * k)) == k + 1
    job, good = client.submit(prompt="a" * k, model=MODEL, top_k=3), submit_good(client)
    work(worker)
    status = client.status(job)
    if k + 1 <= CONTEXT:
        assert status.state == JobState.FINISHED and status.n_tokens == k + 1
    else:  # known only once the worker tokenized it
        assert status.state == JobState.FAILED and status.error["type"] == "PromptTooLong"
        assert f"{k + 1} tokens" in status.error["message"]
    assert_good(client, good, tiny64)


def test_empty_whitespace_and_bos_only_prompts(stack, tiny64):
    worker, client = stack()
    for blank in ("", " ", "\n\t "):
        with pytest.raises(InvalidRequest, match="^prompt is empty$"):
            client.submit(prompt=blank, model=MODEL)
    with pytest.raises(InvalidRequest, match="^tokens is empty$"):
        client.submit(tokens=[], model=MODEL)
    bos_ids = client.submit(tokens=[2], model=MODEL, top_k=3)
    bos_text = client.submit(prompt="<bos>", model=MODEL, top_k=3)
    work(worker)
    assert_logits(client.result(bos_ids, timeout=0), tiny64, [2])
    assert client.status(bos_text).n_tokens == 2  # the BOS added, and the one parsed
    assert_logits(client.result(bos_text, timeout=0), tiny64, [2, 2])


@pytest.mark.parametrize("request_, error, match", [
    ({"tokens": ["a"]}, InvalidRequest, r"^tokens\[0\] must be an integer, got str 'a'"),
    ({"tokens": {"a": 1}}, InvalidRequest, "^tokens must be a list of integer token ids"),
    ({"tokens": [2, 1.5]}, InvalidRequest, r"^tokens\[1\] must be an integer, got float"),
    ({"tokens": [2, True]}, InvalidRequest, r"^tokens\[1\] must be an integer, got bool"),
    ({"tokens": [2, VOCAB]}, TokenOutOfRange, f"token id {VOCAB} is outside"),
    ({"tokens": [2, -1]}, TokenOutOfRange, "token id -1 is outside"),
    ({"tokens": [2, 2**80]}, TokenOutOfRange, "is outside the vocabulary"),
    ({"prompt": "x", "tokens": [2]}, InvalidRequest, "got prompt and tokens"),
    ({"prompt": "\ud800abc"}, InvalidRequest, "^prompt is not valid text: '\\\\ud800' at index 0"),
    ({"messages": [{"role": "user", "content": "a\udfffb"}]}, InvalidRequest,
     r"^messages\[0\].content is not valid text"),
    ({"prompt": "x", "model": "nope"}, UnknownModel, "no registered worker serves model 'nope'"),
    ({"prompt": "x", "top_k": 10**6}, InvalidRequest, r"^top_k must be in \[0, 1000\]"),
    ({"prompt": "x", "top_k": "3"}, InvalidRequest, "^top_k must be an integer, got str"),
])
def test_the_issues_cases_are_typed_and_name_the_field(stack, request_, error, match):
    _, client = stack()
    with pytest.raises(error, match=match) as raised:
        client.submit(**{"model": MODEL, **request_})
    assert not isinstance(raised.value, (TypeError, UnicodeError, KeyError))


def test_a_10_mb_prompt_is_refused_at_submit_in_milliseconds(stack):
    _, client = stack()
    before = client.redis.dbsize()
    for prompt in ("x" * 10_000_000, "\u00e9" * 5_000_000):  # 10 MB either way
        t0 = time.perf_counter()
        with pytest.raises(PromptTooLarge, match="more than the limit of 8388608"):
            client.submit(prompt=prompt, model=MODEL)
        assert time.perf_counter() - t0 < 1.0
    with pytest.raises(PromptTooLarge, match="^messages have 10000004 UTF-8 bytes"):
        client.submit(messages=[{"role": "user", "content": "x" * 10_000_000}], model=MODEL)
    assert client.redis.dbsize() == before and isinstance(PromptTooLarge("x"), PromptTooLong)


def test_a_10_mb_prompt_enqueued_by_a_foreign_client_fails_before_tokenizing(stack, tiny64):
    worker, client = stack()
    record = JobRecord(job_id="big", model=MODEL, prompt="the " * 2_500_000)  # 10 MB
    client.redis.hset(keys.job("big"), mapping=record.to_hash())
    intake_queue(client.redis, MODEL).enqueue_call("worker.tasks.advance_prefill",
                                                   args=("big",), timeout=-1)
    good = submit_good(client)
    t0 = time.perf_counter()
    work(worker)
    assert time.perf_counter() - t0 < 5.0  # tokenizing it would take ~15 s
    status = client.status("big")
    assert status.state == JobState.FAILED and status.error["type"] == "PromptTooLarge"
    assert status.n_tokens is None  # never tokenized
    assert_good(client, good, tiny64)
