"""`jobs.result`: what the worker writes for a finished job decodes to what it wrote."""

from __future__ import annotations

import array
import math
import struct

import pytest

from jobs.errors import CorruptJob
from jobs.protocol import result_of
from jobs.result import (
    PrefillResult,
    TopLogit,
    logits_blob,
    prompt_logprobs_blob,
    prompt_logprobs_of,
    result_blob,
)

TOP = [TopLogit(id=506, logit=19.09, logprob=-1.654, piece=" the"),
       TopLogit(id=9079, logit=18.27, logprob=-2.477, piece=" Paris")]
TIMINGS = {"queue_wait_s": 0.5, "prefill_s": 2.0, "compute_s": 1.5, "tokens_per_s": 3.0}


def test_a_result_with_its_logits_decodes_to_what_was_written():
    blob = result_blob(n_tokens=6, cached_tokens=2, reuse="live", chunks_done=1, top_k=TOP,
                       timings=TIMINGS, model_sha256="ab" * 32)
    logits = array.array("f", [0.5, -1.25, 3.0])
    got = PrefillResult.from_blob("j1", blob, logits_blob(logits.tobytes()))
    assert (got.job_id, got.n_tokens, got.cached_tokens, got.reuse, got.chunks_done) == (
        "j1", 6, 2, "live", 1)
    assert got.top_k == TOP and got.timings == TIMINGS and got.model_sha256 == "ab" * 32
    assert got.logits == logits and got.prompt_logprobs is None
    assert PrefillResult.from_blob("j1", blob, None).logits is None


def test_prompt_logprobs_decode_per_position_with_none_where_there_is_no_value():
    def f32(*values):
        return struct.pack(f"<{len(values)}f", *values)

    def i32(*values):
        return struct.pack(f"<{len(values)}i", *values)

    blob = prompt_logprobs_blob(k=1, ids=i32(2, 818), token_logprob=f32(math.nan, -3.5, math.nan),
                                top_ids=i32(-1, 818, 506), top_logprobs=f32(math.nan, -3.5,
                                                                            -1.0))
    assert prompt_logprobs_of(blob) == [
        {"token": 2, "logprob": None, "top": []},
        {"token": 818, "logprob": -3.5, "top": [{"id": 818, "logprob": -3.5}]},
        {"token": None, "logprob": None, "top": [{"id": 506, "logprob": -1.0}]}]


def test_a_result_that_does_not_decode_is_a_corrupt_job():
    with pytest.raises(CorruptJob, match="job j2's result cannot be decoded"):
        result_of("j2", b"\xc1", None)
