"""The benchmark harness runs end to end on the tiny model (numbers are not asserted: speed
targets live in `python -m bench`, not in timed tests)."""

from __future__ import annotations

import json

import pytest

from bench.common import Recorder, interleaved
from bench.profile import profile
from bench.queue import queue_overhead_per_chunk


def test_interleaved_alternates_order_and_keeps_each_fastest():
    calls: list[str] = []
    seconds = iter([3.0, 5.0, 2.0, 1.0, 4.0, 6.0])

    def make(name: str):
        def fn() -> float:
            calls.append(name)
            return next(seconds)
        return fn

    fastest = interleaved(make("a"), make("b"), repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert fastest == [1.0, 2.0]  # a got 3, 1, 4; b got 5, 2, 6


def test_queued_prefill_runs_a_job_through_a_real_redis(tiny):
    from bench.queue import queued_prefill

    ids = [i % tiny.vocab_size for i in range(40)]
    with queued_prefill(tiny) as submit_and_work:
        result = submit_and_work(ids)
    assert result.n_tokens == 40
    assert result.top_k[0].id == int(tiny.start_prefill(ids).run().argmax())
    assert 0 < result.timings["compute_s"] <= result.timings["prefill_s"]


def test_queue_overhead_is_measured_through_a_real_redis(capsys):
    rec = Recorder(True, {})
    queue_overhead_per_chunk(rec, chunks=8, chunk_tokens=4, repeats=1)
    overhead, commands = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert overhead["metric"] == "queue_overhead_ms_per_chunk"
    assert overhead["unit"] == "ms" and overhead["chunks"] == 8
    assert 0 < overhead["value"] < 10_000
    assert commands["metric"] == "redis_commands_per_chunk"
    assert commands["value"] == pytest.approx(sum(commands["by_command"].values()))
    assert commands["by_command"]["evalsha"] == pytest.approx(1.0)  # one script per chunk


def test_profile_groups_add_up_to_a_chunk(tiny):
    rows = {r["group"]: r for r in profile(tiny, chunk=24, position=24, repeats=1)}
    assert {"attention_local", "attention_global", "mlp_matmuls", "gelu_mul"} <= rows.keys()
    assert rows["measured_chunk"]["ms_per_chunk"] > 0
    groups = [r for name, r in rows.items() if name not in ("sum_of_groups", "measured_chunk")]
    assert rows["sum_of_groups"]["ms_per_chunk"] == round(
        sum(r["ms_per_chunk"] for r in groups), 1)


def test_bounded_records_say_whether_they_hold(capsys):
    rec = Recorder(True, {})
    rec("a_over_b", 0.93, "ratio", floor=0.95)
    rec("wait", 0.7, "ratio", ceiling=1.5)
    rec("tok_s", 200.0, "tok/s")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("holds") for r in lines] == [False, True, None]
    assert rec.bounds_report() == ["MISSED a_over_b = 0.93 (want >= 0.95)",
                                   "holds  wait = 0.7 (want <= 1.5)"]


def test_scale_runs_worker_processes_on_one_redis(capsys, tmp_path):
    from bench.scale import main

    out = tmp_path / "scale.jsonl"
    assert main(["--workers", "2", "--jobs", "4", "--chunks-per-job", "16", "--warmup", "0",
                 "--seconds", "1.5", "--worker-args", "--max-batch-jobs 1", "--json",
                 "--out", str(out)]) == 0
    records = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(records) == {"scale_chunks_per_s", "scale_redis_commands_per_s",
                            "scale_redis_commands_per_chunk", "scale_redis_cpu_fraction",
                            "scale_redis_cpu_us_per_chunk", "gpu_workers_per_redis_primary"}
    for r in records.values():
        assert r["workers"] == 2 and r["jobs"] == 4 and r["chunk_tokens"] == 16
        assert r["machine_cores"] >= 1 and 0 < r["chunks"] <= 4 * 16
        assert r["window_s"] >= 1.5 and r["value"] > 0
    per_chunk = records["scale_redis_commands_per_chunk"]
    assert per_chunk["by_command"]["evalsha"] > 0  # the chunk's progress script
    # one-job steps (--worker-args reached the workers): each step reads the cancel flag of
    # the other job resident on its worker
    assert per_chunk["by_command"]["exists"] > 0.5
    assert records["scale_redis_cpu_fraction"]["value"] < 1
    context = json.loads(out.read_text().splitlines()[0])["context"]
    assert context["workers"] == 2 and context["worker_args"] == "--max-batch-jobs 1"


def test_session_turn_over_cold_runs_on_the_tiny_model(capsys, tiny):
    from bench.session import session_turn_over_cold

    ids = [2, *(260 + i % 100 for i in range(231))]
    session_turn_over_cold(Recorder(True, {}), tiny, history=200, new=16, turns=2, ids=ids)
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert record["metric"] == "session_turn_over_cold"
    assert record["reuse"] == "live" and record["cached_tokens"] in (200, 216)
    assert len(record["ratios"]) == 2
    assert record["value"] == pytest.approx(min(record["ratios"]), abs=1e-4)


def test_gateway_bench_runs_worker_and_gateway_processes(capsys):
    from bench.gateway import measure

    rec = Recorder(True, {})
    measure(rec, "gemma3-tiny", rounds=1, poll_seconds=0.2,
            ids=lambda n: [2, *((260 + i) % 365 for i in range(n - 1))])
    metrics = {r["metric"]: r for r in rec.records}
    assert set(metrics) == {"gateway_over_native", "gateway_overhead_ms", "status_polls_per_s",
                            "native_status_polls_per_s"}
    assert metrics["gateway_over_native"]["value"] > 0 and "holds" in metrics[
        "gateway_over_native"]
    assert metrics["status_polls_per_s"]["value"] > 0
    assert all(json.loads(line)["metric"] in metrics
               for line in capsys.readouterr().out.splitlines())
