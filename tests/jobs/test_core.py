"""`jobs.core` and `jobs.requests.SubmitRequest`: the submit fields are defined once (both
clients' ``submit``, the CLI's flags and the gateway's body follow the dataclass), and a plan
is driven without Redis: its round trips are built, its replies decoded, its errors raised."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest
from redis.exceptions import OutOfMemoryError

from jobs import AsyncPrefillClient, JobNotFound, Limits, PrefillClient, core, keys
from jobs.cli import SUBMIT_DEFAULTS, SUBMIT_FLAGS, OneLineParser, add_submit
from jobs.gateway.native import submit_fields
from jobs.record import JobRecord
from jobs.requests import RECORD_FIELD, SUBMIT_FIELDS, SubmitRequest, check_record
from jobs.serializer import packb

FIELDS = dataclasses.fields(SubmitRequest)


@pytest.mark.parametrize("client", [PrefillClient, AsyncPrefillClient])
def test_each_client_s_submit_takes_the_submit_request_s_fields(client):
    params = list(inspect.signature(client.submit).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in FIELDS]
    assert [p.default for p in params] == [f.default for f in FIELDS]
    assert params[0].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD  # submit("text")
    with pytest.raises(TypeError, match="tokenz"):  # a misspelt keyword, before any I/O
        outcome = client.submit(None, tokenz=[1])
        if inspect.iscoroutine(outcome):
            asyncio.run(outcome)


def test_the_cli_flags_are_fields_with_the_fields_defaults():
    sub = OneLineParser(prog="prefillq").add_subparsers()
    add_submit(sub)
    args = sub.choices["submit"].parse_args(["--prompt", "x"])
    assert set(SUBMIT_FLAGS) <= SUBMIT_FIELDS
    assert {n: getattr(args, n) for n in SUBMIT_FLAGS} == {
        n: SUBMIT_DEFAULTS[n].value if n == "logits" else SUBMIT_DEFAULTS[n]
        for n in SUBMIT_FLAGS}


def test_the_gateway_body_takes_every_field():
    body = {f.name: f.default for f in FIELDS}
    assert submit_fields(body) == body


def test_the_record_stores_every_field_with_its_default():
    stored = {f.name: f.default for f in dataclasses.fields(JobRecord)}
    for f in FIELDS:
        # a record always names its model: no default there
        expected = dataclasses.MISSING if f.name == "model" else f.default
        assert stored[RECORD_FIELD.get(f.name, f.name)] == expected, f.name


def test_a_record_gives_back_the_checked_request():
    request = SubmitRequest(tokens=(2, 5), model="m", top_k=3, logits="full", priority=-2,
                            chunk_tokens=8, idempotency_key="k", max_attempts=2).checked()
    record = request.record("j", enqueued_at=1.0)
    assert record.logits_mode == "full" and record.tokens == [2, 5] and record.enqueued_at == 1.0
    assert SubmitRequest.of_record(record) == request
    check_record(record)


def test_a_status_plan_reads_the_record_and_raises_job_not_found_on_none():
    plan = core.status("j1")
    trip = next(plan)
    assert trip.call is None and not trip.transaction
    with pytest.raises(JobNotFound):
        plan.send([{}])


def test_a_submit_whose_multi_fails_frees_its_idempotency_key():
    info = packb({"vocab_size": 100, "context_length": 64, "architecture": "gemma3",
                  "sha256": "0" * 64})
    request = SubmitRequest(tokens=[1, 2], model="m", idempotency_key="k")
    run = core.Run(core.submit(request, Limits(), max_queue_depth=10, result_ttl_s=60))
    # model and prefix root, priorities, tenants' levels and quota, depth, the claim
    replies = iter([[info, None], [set(), set(), None], [0], [True]])
    for _ in range(4):
        run.settle(lambda trip: next(replies))
    assert run.trip.transaction  # the record and its RQ job

    def refused(trip):
        raise OutOfMemoryError("OOM command not allowed")

    run.settle(refused)
    assert run.trip.call.name == "release" and run.trip.call.keys == (keys.idempotency("k"),)
    with pytest.raises(OutOfMemoryError):
        run.settle(lambda trip: [1])
