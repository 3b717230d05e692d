"""Load: mixed-length jobs across ``prefillq worker`` processes on one real redis-server
(`bench.load`, the same code path as ``python -m bench.load``). Every job finishes exactly
once (its status, one terminal message on its channel, the cluster's counters), and once
the TTLs expire Redis holds what it held at the baseline: no key that names a job, no key
that grew (`bench.load_report.keys_grown`), at most a connection more per worker, and
memory apart from the connections' buffers within `bench.load_report.MEMORY_MARGIN`."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from bench.load import LENGTH_CLASSES, TOKEN_IDS, LoadConfig, plan_jobs, run_load
from bench.load_report import (
    MEMORY_MARGIN,
    by_class,
    exactly_once_problems,
    finished_once,
    job_keys_left,
    keys_grown,
    memory_growth,
)
from bench.observe import key_pattern

JOB = "0123456789abcdef0123456789abcdef"


def test_a_plan_mixes_the_length_classes_in_their_shares():
    planned = plan_jobs(60, seed=3)
    classes = [c for c, _ in planned]
    assert {c: classes.count(c) for c in LENGTH_CLASSES} == {"short": 30, "medium": 18,
                                                             "long": 12}
    assert classes[:30].count("short") < 30  # shuffled, not in blocks
    for cls, ids in planned:
        lo, hi = LENGTH_CLASSES[cls]
        assert lo <= len(ids) <= hi and ids[0] == 2
        assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for t in ids[1:])
    assert plan_jobs(60, seed=3) == planned != plan_jobs(60, seed=4)


def test_key_patterns_hide_job_ids_and_keep_model_hashes():
    sha = "ab" * 32
    assert key_pattern(f"prefillq:{{{JOB}}}:job") == "prefillq:{*}:job"
    assert key_pattern(f"rq:job:{JOB}-0123456789ab") == "rq:job:*"
    assert key_pattern(f"prefillq:idem:{JOB}") == "prefillq:idem:*"
    assert key_pattern(f"prefillq:tokenizer:{sha}") == f"prefillq:tokenizer:{sha}"
    assert key_pattern("prefillq:worker:w1:heartbeat") == "prefillq:worker:w1:heartbeat"


def test_keys_grown_finds_a_key_that_collects_jobs_and_new_keys_that_never_expire():
    def row(count, size, no_ttl=1):
        return {"count": count, "bytes": size, "no_ttl": no_ttl}

    base = {"prefillq:stats": row(1, 280), "prefillq:worker:w1:jobs": row(1, 100),
            "rq:worker:w1": row(1, 440, 0)}
    after = {"prefillq:stats": row(1, 376),  # digits and histogram fields
             "prefillq:worker:w1:jobs": row(1, 100 + 60 * 34),  # 60 job ids kept
             "rq:worker:w1": row(1, 440, 0), "rq:clean_groups": row(1, 72, 0),
             "prefillq:leftover": row(1, 90)}
    run = SimpleNamespace(warmup=SimpleNamespace(keys=base), load=SimpleNamespace(keys=after))
    assert set(keys_grown(run)) == {"prefillq:worker:w1:jobs", "prefillq:leftover"}


def assert_load_holds(run) -> None:
    cfg = run.config
    assert exactly_once_problems(run.warmup, cfg.warmup_jobs) == []
    assert exactly_once_problems(run.load, cfg.jobs) == []
    assert finished_once(run.load) == cfg.jobs
    assert run.worker_exit_codes == [0] * cfg.workers
    rows = by_class(run.load)
    assert {c: rows[c]["jobs"] for c in LENGTH_CLASSES} == Counter(run.load.classes.values())
    assert all(0 < r["p50_s"] <= r["p99_s"] <= r["max_s"] for r in rows.values())
    assert all(0 < r["run_p50_s"] <= r["p50_s"] for r in rows.values())
    # what stays once the TTLs expired: only what the baseline held
    assert job_keys_left(run.load) == {}, run.load.keys
    assert keys_grown(run) == {}
    base, after = run.warmup.memory, run.load.memory
    # a worker's pool opens a connection per thread that uses it at once (chunk loop,
    # heartbeat, checkpoint writer): at most one more than the baseline's per worker
    assert base["connections"] <= after["connections"] <= base["connections"] + cfg.workers
    assert run.load.peak > base["used_memory"]  # the sampler saw the jobs' data
    first_called = sorted(set(after["commands"]) - set(base["commands"]))
    assert abs(memory_growth(run)) <= MEMORY_MARGIN, (memory_growth(run), first_called,
                                                      base, after)


def test_60_mixed_jobs_on_3_workers_finish_once_and_memory_returns(tmp_path):
    # ~25 s on 2 busy cores: a 3 s TTL, 12 warm-up jobs, generous waits
    run = run_load(LoadConfig(jobs=60, workers=3, ttl_s=3, timeout_s=600), tmp_path)
    assert_load_holds(run)


@pytest.mark.long
def test_1000_mixed_jobs_on_3_workers_finish_once_and_memory_returns(tmp_path):
    run = run_load(LoadConfig(jobs=1000, workers=3, ttl_s=5, timeout_s=3600), tmp_path)
    assert_load_holds(run)
