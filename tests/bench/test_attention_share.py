"""`bench.prefill.attention_share`: the two chunks it times and the share it solves for."""

from __future__ import annotations

import pytest

from bench import prefill
from bench.common import Recorder


class Loaded:
    """A `LoadedModel` whose name has a reference prompt and whose prefills are the tiny
    Gemma's, so the function runs end to end in milliseconds."""

    def __init__(self, tiny):
        self.name, self._tiny = "gemma3-270m", tiny

    def start_prefill(self, ids, chunk_tokens):
        return self._tiny.start_prefill([i % self._tiny.vocab_size for i in ids], chunk_tokens)


def test_the_share_is_solved_from_the_two_chunks_it_records(tiny):
    rec = Recorder(False, {})
    prefill.attention_share(rec, Loaded(tiny), chunk=32, repeats=1)
    (record,) = rec.records
    assert record["metric"] == "attention_share" and record["n_tokens"] == 64
    t1, t2 = record["first_chunk_s"], record["second_chunk_s"]
    assert record["value"] == pytest.approx(2 * (t2 - t1) / (t1 + t2), abs=2e-3)
    assert record["linear_s_per_chunk"] == pytest.approx(t1 - (t2 - t1) / 2, abs=2e-3)
