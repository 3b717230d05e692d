"""`python -m bench.lengths`: the records it writes and how they relate."""

from __future__ import annotations

import json

from bench import lengths


def test_the_records_are_per_job_times_and_their_difference(tiny, tmp_path):
    out = tmp_path / "lengths.jsonl"
    assert lengths.main(["--model", "gemma3-tiny", "--lengths", "3", "--json",
                         "--out", str(out)]) == 0
    context, *records = [json.loads(line) for line in out.read_text().splitlines()]
    assert context["context"]["new_lengths"] == [33, 34, 35]
    by_metric = {r["metric"]: r["value"] for r in records}
    assert set(by_metric) == {"prefill_ms_repeated_length", "prefill_ms_new_length",
                              "prefill_ms_seen_length", "new_length_cost_ms",
                              "attention_ms_new_shape", "attention_ms_seen_shape"}
    assert all(v > 0 for k, v in by_metric.items() if k != "new_length_cost_ms")
    cost = by_metric["prefill_ms_new_length"] - by_metric["prefill_ms_seen_length"]
    assert abs(by_metric["new_length_cost_ms"] - cost) < 1e-3
