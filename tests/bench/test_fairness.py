"""`bench.fairness`: a short run end to end through a real redis-server and real
``prefillq worker`` processes on the tiny Gemma 3: the records' shape, and what holds
whatever the machine (every short job is timed once; the flood's service while short jobs
waited is sampled)."""

from __future__ import annotations

import json

from bench.fairness import main


def test_both_arms_time_every_short_job_and_the_fair_arm_samples_the_service(tmp_path):
    out = tmp_path / "fairness.jsonl"
    assert main(["--flood-jobs", "4", "--flood-tokens", "256", "--tenants", "2",
                 "--short-jobs", "2", "--short-tokens", "32", "--workers", "1", "--json",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["tenants"] == 2
    records = lines[1:]
    p99 = {(r["arm"], r["tenant"]): r["value"] for r in records
           if r["metric"] == "fairness_latency_p99_s"}
    assert set(p99) == {(a, t) for a in ("fair", "fifo") for t in ("t0", "t1")}
    assert all(v > 0 for v in p99.values())
    (speedup,) = [r for r in records if r["metric"] == "fairness_p99_speedup"]
    assert speedup["value"] > 0
    (flood,) = [r for r in records if r["metric"] == "fairness_flood_tokens_while_waiting"]
    assert flood["value"] >= 0 and flood["workers"] == 1 and "holds" in flood
