"""`jobs.limits.Limits`: configurable, with safe defaults, enforced at `submit` by both clients
and again by the worker when it starts a job (a job a permissive or foreign client enqueued
that breaks the worker's limits fails with the typed error; the worker carries on)."""

from __future__ import annotations

import asyncio

import pytest

from jobs import (
    AsyncPrefillClient,
    InvalidRequest,
    JobState,
    Limits,
    PrefillClient,
    PromptTooLarge,
    PromptTooLong,
)
from jobs.defaults import DEFAULT_MAX_PROMPT_BYTES, MAX_TOP_K
from worker.cli import build_parser
from worker.cli.work import limits_of

from .helpers import GOOD, MODEL, assert_good, submit_good, work


def test_defaults_are_safe_and_bad_limits_are_refused():
    limits = Limits()
    assert limits.max_prompt_bytes == DEFAULT_MAX_PROMPT_BYTES == 8 * 2**20
    assert (limits.max_prompt_tokens, limits.max_top_k, limits.max_prompt_logprobs) == (
        None, MAX_TOP_K, 20)
    assert limits.prompt_tokens(4096) == 4096 and Limits(max_prompt_tokens=10).prompt_tokens(
        4096) == 10 and Limits(max_prompt_tokens=10**9).prompt_tokens(64) == 64
    for bad in ({"max_prompt_bytes": 0}, {"max_prompt_tokens": 0}, {"max_top_k": -1},
                {"max_prompt_logprobs": 1.5}, {"max_prompt_bytes": True}):
        with pytest.raises(ValueError, match=f"Limits.{next(iter(bad))} must be an integer"):
            Limits(**bad)
    with pytest.raises(AttributeError):  # frozen: one client's limits cannot drift
        limits.max_top_k = 5


def test_the_client_counts_prompt_bytes_in_utf8(stack):
    _, client = stack(client_limits=Limits(max_prompt_bytes=100))
    client.submit(prompt="x" * 100, model=MODEL)
    client.submit(prompt="\u00e9" * 50, model=MODEL)  # 2 bytes each: 100
    for prompt in ("x" * 101, "\u00e9" * 51, "\U0001f600" * 26):
        with pytest.raises(PromptTooLarge, match="more than the limit of 100"):
            client.submit(prompt=prompt, model=MODEL)
    chat = [{"role": "user", "content": "x" * 48}, {"role": "assistant", "content": "y" * 39}]
    client.submit(messages=chat, model=MODEL)  # roles and contents: 4 + 48 + 9 + 39 = 100
    with pytest.raises(PromptTooLarge, match="^messages have 101 UTF-8 bytes"):
        client.submit(messages=[*chat[:1], {"role": "assistant", "content": "y" * 40}],
                      model=MODEL)


def test_the_client_limits_tokens_top_k_and_prompt_logprobs(stack):
    _, client = stack(client_limits=Limits(max_prompt_tokens=8, max_top_k=5,
                                           max_prompt_logprobs=2))
    client.submit(tokens=GOOD[:8], model=MODEL, top_k=5, prompt_logprobs=2)
    with pytest.raises(PromptTooLong, match="9 tokens, more than the limit of 8"):
        client.submit(tokens=GOOD[:9], model=MODEL, top_k=5)
    with pytest.raises(InvalidRequest, match=r"^top_k must be in \[0, 5\], got 6"):
        client.submit(tokens=GOOD[:8], model=MODEL, top_k=6)
    with pytest.raises(InvalidRequest, match=r"^prompt_logprobs must be in \[0, 2\], got 3"):
        client.submit(tokens=GOOD[:8], model=MODEL, top_k=5, prompt_logprobs=3)
    wide = PrefillClient(client.redis, limits=Limits(max_prompt_logprobs=50))
    wide.submit(tokens=GOOD, model=MODEL, prompt_logprobs=50)
    with pytest.raises(InvalidRequest, match="prompt_logprobs must be in"):  # the default: 20
        PrefillClient(client.redis).submit(tokens=GOOD, model=MODEL, prompt_logprobs=21)


@pytest.mark.parametrize("worker_limits, request_, error_type, message", [
    (Limits(max_prompt_tokens=41), {"prompt": "a" * 41}, "PromptTooLong",
     "42 tokens, more than the limit of 41"),
    (Limits(max_top_k=5), {"tokens": GOOD, "top_k": 10}, "InvalidRequest",
     "top_k must be in [0, 5], got 10"),
    (Limits(max_prompt_bytes=1000), {"prompt": "b" * 2000}, "PromptTooLarge",
     "prompt has at least 2000 UTF-8 bytes, more than the limit of 1000"),
    (Limits(max_prompt_bytes=1000), {"messages": [{"role": "user", "content": "c" * 2000}]},
     "PromptTooLarge", "messages have 2004 UTF-8 bytes"),
    (Limits(max_prompt_logprobs=2), {"tokens": GOOD, "prompt_logprobs": 3}, "InvalidRequest",
     "prompt_logprobs must be in [0, 2], got 3"),
])
def test_the_worker_enforces_its_own_limits_again(stack, tiny64, worker_limits, request_,
                                                   error_type, message):
    worker, client = stack(worker_limits=worker_limits)  # the client's limits are the defaults
    job = client.submit(model=MODEL, **request_)
    good = submit_good(client)
    work(worker)
    status = client.status(job)
    assert status.state == JobState.FAILED and status.error["type"] == error_type
    assert message in status.error["message"]
    assert status.n_tokens is None  # refused before it was tokenized or planned
    assert_good(client, good, tiny64)


def test_the_async_client_takes_limits_too(redis_server, stack):
    stack()  # registers the model on the real server (and flushes it)

    async def submit(**kwargs):
        async with AsyncPrefillClient.from_url(redis_server,
                                               limits=Limits(max_prompt_bytes=10)) as c:
            return await c.submit(model=MODEL, **kwargs)

    with pytest.raises(PromptTooLarge, match="more than the limit of 10"):
        asyncio.run(submit(prompt="x" * 11))
    with pytest.raises(InvalidRequest, match=r"^tokens\[0\] must be an integer, got float"):
        asyncio.run(submit(tokens=[1.0]))
    assert isinstance(asyncio.run(submit(prompt="x" * 10)), str)


def test_worker_flags_set_its_limits():
    args = build_parser().parse_args(["worker"])
    assert limits_of(args) == Limits()
    args = build_parser().parse_args(["worker", "--max-prompt-bytes", "4096", "--max-top-k",
                                      "50", "--max-prompt-logprobs", "0"])
    assert limits_of(args) == Limits(max_prompt_bytes=4096, max_top_k=50,
                                     max_prompt_logprobs=0)


@pytest.mark.parametrize("flags", [("--max-prompt-bytes", "0"), ("--max-top-k", "-1"),
                                   ("--max-prompt-logprobs", "x"), ("--context", "0")])
def test_bad_worker_limit_flags_exit_two_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["worker", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1
    assert lines[0].startswith(f"prefillq: error: argument {flags[0]}: want an integer")
