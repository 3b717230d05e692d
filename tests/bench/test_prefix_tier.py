"""`bench.prefix_tier`: a short run end to end through a real redis-server on the tiny Gemma 3
(the records' shape, and that every block round-trips through the store)."""

from __future__ import annotations

import json

from bench.prefix_tier import main


def test_compute_and_fetch_are_measured_per_token_side_by_side(tmp_path):
    out = tmp_path / "tier.jsonl"
    assert main(["--models", "gemma3-tiny", "--tokens", "100", "--repeats", "1", "--json",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["models"] == ["gemma3-tiny"]
    records = {r["metric"]: r for r in lines[1:]}
    compute = records["prefix_tier_compute_us_per_token"]
    fetch = records["prefix_tier_fetch_us_per_token"]
    assert compute["tokens"] == fetch["tokens"] == 96  # 3 whole blocks of 100 tokens
    assert compute["value"] > 0 and fetch["value"] > 0 and fetch["block_bytes"] > 0
    speedup = records["prefix_tier_fetch_speedup"]["value"]
    assert abs(speedup / (compute["value"] / fetch["value"]) - 1) < 1e-2  # rounded values
