"""The benchmark harness runs end to end on the tiny model (numbers are not asserted: speed
targets live in `python -m bench`, not in timed tests)."""

from __future__ import annotations

import json

from bench.common import Recorder, interleaved
from bench.profile import profile
from bench.queue import queue_overhead_per_chunk


def test_interleaved_alternates_and_keeps_each_fastest(monkeypatch):
    calls: list[str] = []
    clock = iter(range(100))
    monkeypatch.setattr("bench.common.time.perf_counter", lambda: next(clock))

    def make(name: str):
        return lambda: calls.append(name)

    fastest = interleaved(make("a"), make("b"), make("c"), repeats=3)
    assert calls == ["a", "b", "c"] * 3
    assert fastest == [1, 1, 1]  # every fake call spans one tick


def test_queue_overhead_is_measured_through_a_real_redis(capsys):
    rec = Recorder(True, {})
    queue_overhead_per_chunk(rec, chunks=8, chunk_tokens=4, repeats=1)
    record = json.loads(capsys.readouterr().out.strip())
    assert record["metric"] == "queue_overhead_ms_per_chunk"
    assert record["unit"] == "ms" and record["chunks"] == 8
    assert 0 < record["value"] < 10_000


def test_profile_groups_add_up_to_a_chunk(tiny):
    rows = {r["group"]: r for r in profile(tiny, chunk=24, position=24, repeats=1)}
    assert {"attention_local", "attention_global", "mlp_matmuls", "gelu_mul"} <= rows.keys()
    assert rows["measured_chunk"]["ms_per_chunk"] > 0
    groups = [r for name, r in rows.items() if name not in ("sum_of_groups", "measured_chunk")]
    assert rows["sum_of_groups"]["ms_per_chunk"] == round(
        sum(r["ms_per_chunk"] for r in groups), 1)
