"""`JobRecord`, the one codec of the job hash: round trips through a real Redis hash."""

from __future__ import annotations

import dataclasses

import pytest

from jobs import CorruptJob, JobState, LogitsMode, PrefillQError
from jobs.defaults import DEFAULT_MAX_ATTEMPTS, DEFAULT_TOP_K
from jobs.record import JobRecord
from jobs.serializer import packb


def roundtrip(redis_conn, record: JobRecord) -> JobRecord:
    r = redis_conn()
    r.delete("rec")
    r.hset("rec", mapping=record.to_hash())
    return JobRecord.from_hash(record.job_id, r.hgetall("rec"))


def test_every_field_survives_redis(redis_conn):
    record = JobRecord(
        job_id="j1", model="gemma3-tiny", tokens=[2, 0, 262_143],
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False, top_k=0,
        logits_mode=LogitsMode.FULL, parse_special=False, priority=-3, chunk_tokens=7,
        session="s", idempotency_key="k", max_attempts=5, enqueued_at=1.25,
        state=JobState.FAILED, attempts=2, failures=1, cursor=40, chunks_done=3,
        cached_tokens=8, n_tokens=41, recovery_position=33, chunk_plan=[16, 32, 41],
        cancel_requested=True, worker="w", start_token="t", first_started_at=2.0,
        started_at=2.5, updated_at=3.0, finished_at=3.5, error_type="ModelError",
        error_message="boom", result=b"\x00\xff msgpack",
    )
    assert roundtrip(redis_conn, record) == record


def test_messages_and_the_generation_flag_survive_redis(redis_conn):
    chat = [{"role": "system", "content": "Sé breve. <b>\u2581</b>"},
            {"role": "user", "content": "<start_of_turn>Hi\n"},
            {"role": "assistant", "content": ""}]
    record = JobRecord(job_id="j6", model="m", messages=chat, add_generation_prompt=False)
    written = record.to_hash()
    assert isinstance(written["messages"], bytes) and written["add_generation_prompt"] == 0
    back = roundtrip(redis_conn, record)
    assert back.messages == chat and back.add_generation_prompt is False
    assert back.prompt is None and back.tokens is None
    assert roundtrip(redis_conn, JobRecord(job_id="j7", model="m", prompt="hi")).messages is None


def test_missing_fields_take_the_dataclass_defaults(redis_conn):
    back = roundtrip(redis_conn, JobRecord(job_id="j2", model="m", prompt="hi"))
    assert back.state is JobState.QUEUED
    assert back.top_k == DEFAULT_TOP_K and back.max_attempts == DEFAULT_MAX_ATTEMPTS
    assert back.tokens is None and back.chunk_plan is None and back.worker is None
    assert back.parse_special is True and back.cancel_requested is False
    assert back.messages is None and back.add_generation_prompt is True


def test_none_fields_are_not_written():
    written = JobRecord(job_id="j3", model="m", prompt="hi").to_hash()
    assert "tokens" not in written and "worker" not in written and "result" not in written
    assert written["parse_special"] == 1 and written["state"] == "queued"


def test_an_empty_string_reads_as_unset():
    # the requeue script clears the holder with HSET worker ''
    raw = {b"model": b"m", b"state": b"queued", b"worker": b"", b"n_tokens": b"12"}
    record = JobRecord.from_hash("j4", raw)
    assert record.worker is None and record.n_tokens == 12
    assert record.status().worker is None and record.status().progress == 0.0


def test_status_derives_progress_and_error():
    record = JobRecord(job_id="j5", model="m", n_tokens=40, cursor=10, state=JobState.FAILED,
                       error_type="PromptTooLong", error_message="too long")
    status = record.status()
    assert status.progress == pytest.approx(0.25)
    assert status.error == {"type": "PromptTooLong", "message": "too long"}
    assert set(status.to_dict()) == {f.name for f in dataclasses.fields(status)}


def test_a_corrupt_field_raises_value_error():
    with pytest.raises(ValueError):
        JobRecord.from_hash("j6", {b"model": b"m", b"cursor": b"ten"})
    for not_a_chat in (packb("hi"), packb([1, 2])):
        with pytest.raises(ValueError, match="messages"):
            JobRecord.from_hash("j6", {b"model": b"m", b"messages": not_a_chat})


def test_a_corrupt_record_is_corrupt_job_naming_every_bad_field():
    raw = {b"model": b"m", b"state": b"queued", b"cursor": b"ten", b"tokens": b"\xc1",
           b"prompt": b"\xff"}
    with pytest.raises(CorruptJob, match="cannot be decoded: cursor .*; prompt .*; tokens") as e:
        JobRecord.from_hash("j7", raw)
    assert e.value.fields == ("cursor", "prompt", "tokens")
    assert isinstance(e.value, ValueError) and isinstance(e.value, PrefillQError)


def test_float_or_bool_token_ids_in_a_record_are_corrupt_never_truncated():
    for ids in ([2.0, 3.0], [True], [1, "2"], {"a": 1}, 5):
        with pytest.raises(CorruptJob, match="tokens"):
            JobRecord.from_hash("j8", {b"model": b"m", b"state": b"queued",
                                       b"tokens": packb(ids)})
    assert JobRecord.from_hash("j8", {b"model": b"m", b"state": b"queued",
                                      b"tokens": packb([2, 3])}).tokens == [2, 3]


def test_a_record_without_a_state_is_corrupt():
    with pytest.raises(CorruptJob, match=r"state \(missing\)") as e:
        JobRecord.from_hash("j9", {b"model": b"m", b"tokens": packb([2])})
    assert e.value.fields == ("state",)
