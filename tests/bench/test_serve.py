"""`bench.serve`: arms parsed from the command line, and a short run end to end through a
real redis-server and real ``prefillq worker`` processes on the tiny Gemma 3 (numbers are
not asserted, only the records' shape and that every job finished with the in-process
top-1 id)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.serve import LENGTHS, Arm, main, parse_arm, plan_prompts, run_jobs, workload


def test_an_arm_is_a_name_and_the_worker_flags_split_as_a_shell_would():
    assert parse_arm("one=--max-active 1") == Arm("one", ("--max-active", "1"))
    assert parse_arm("q=--redis 'a b'") == Arm("q", ("--redis", "a b"))
    assert parse_arm("default=") == Arm("default", ())
    for bad in ("no-equals", "a b=--max-active 1", "=--max-active 1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_arm(bad)


def test_every_arm_gets_the_same_prompts_of_scoring_lengths():
    prompts = plan_prompts(200, "gemma3-tiny", 365, seed=3)
    assert prompts == plan_prompts(200, "gemma3-tiny", 365, seed=3)
    assert all(LENGTHS[0] <= len(p) <= LENGTHS[1] and p[0] == 2 for p in prompts)
    assert all(260 <= i < 365 for p in prompts for i in p[1:])


def test_a_warm_up_of_every_length_runs_each_length_once(tiny):
    work = workload(tiny, "gemma3-tiny", 4, seed=0, every_length=True)
    assert [len(p) for p in work.warmup] == list(range(LENGTHS[0], LENGTHS[1] + 1))
    assert len(workload(tiny, "gemma3-tiny", 4, seed=0).warmup) == 8


def test_two_arms_alternate_through_one_worker_each(capsys, tmp_path):
    out = tmp_path / "serve.jsonl"
    assert main(["--jobs", "12", "--rounds", "1", "--arm", "one=--max-active 1",
                 "--arm", "two=--max-active 8", "--json", "--out", str(out)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [r for r in records if r["metric"] == "serve_jobs_per_s"]
    assert [(r["arm"], r["round"], r["worker_flags"]) for r in runs] == [
        ("one", 0, "--max-active 1"), ("two", 0, "--max-active 8")]
    for r in runs:
        assert r["jobs"] == r["finished"] == 12 and r["worker_exit_code"] == 0
        assert r["top1_checked"] == 4 and r["top1_mismatches"] == 0
        assert r["value"] > 0 and r["tokens_per_s"] > 0 and r["model"] == "gemma3-tiny"
        assert 0 < r["latency_p50_s"] <= r["latency_p99_s"] <= r["wall_s"]
        assert r["redis_commands_per_job"] == pytest.approx(
            sum(r["redis_commands_per_job_by_command"].values()), abs=0.05)
        assert r["redis_commands_per_job_by_command"]["publish"] >= 1  # each job's finished
        assert r["steps"] >= 1 and r["redis_commands_per_step"] == pytest.approx(
            r["redis_commands_per_job"] * r["jobs_per_step"], rel=0.01)
        assert r["machine"]["suite"] == "serve"
    assert runs[0]["jobs_per_step"] <= 1  # one job a step, each a step or more
    medians = {r["arm"]: r for r in records if r["metric"] == "serve_jobs_per_s_median"}
    assert set(medians) == {"one", "two"} and medians["one"]["rounds"] == 1
    (ratio,) = [r for r in records if r["metric"] == "serve_jobs_per_s_over_one"]
    assert ratio["value"] == pytest.approx(runs[1]["value"] / runs[0]["value"], rel=1e-3)
    assert "holds" not in ratio  # the bound is for the one-job/default pair only
    context = json.loads(out.read_text().splitlines()[0])["context"]
    assert context["arms"] == {"one": "--max-active 1", "two": "--max-active 8"}
    assert context["arms_chosen"] == "given" and context["tokens"] == runs[0]["tokens"]


def test_the_hf_peer_batches_the_prompts_as_given_or_longest_first():
    from bench.serve_peer_hf import batches

    prompts = plan_prompts(10, "gemma3-270m-shapes", 262_144, seed=1)
    assert batches(prompts, 4, "submit") == [prompts[:4], prompts[4:8], prompts[8:]]
    by_length = [p for group in batches(prompts, 4, "length") for p in group]
    assert sorted(prompts, key=len, reverse=True) == by_length
    with pytest.raises(ValueError, match="order"):
        batches(prompts, 4, "random")


def test_waiting_for_jobs_ends_when_the_worker_exits(redis_server, tiny):
    """A worker that dies (a crash, an OOM kill) ends the wait at once with the count of
    jobs left, not at the timeout an hour later."""
    import redis

    from worker.settings import WorkerSettings
    from worker.worker import PrefillWorker

    conn = redis.Redis.from_url(redis_server)
    conn.flushall()
    # registered, then gone without a step
    PrefillWorker({"gemma3-tiny": tiny}, conn, WorkerSettings(), name="gone").register_models()
    with pytest.raises(RuntimeError, match="the worker exited with 2 of 2 jobs not ended"):
        run_jobs(conn, redis_server, "gemma3-tiny", [[2, 300], [2, 301]], 3600,
                 alive=lambda: False)
