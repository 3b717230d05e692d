"""`bench.serve_profile`: a short run end to end (a real redis-server, a real ``prefillq
worker`` under cProfile, the tiny Gemma 3); the records' shape and the kept profile, not
their numbers."""

from __future__ import annotations

import json
import pstats

from bench.serve_profile import main


def test_a_profiled_worker_serves_the_jobs_and_its_functions_are_recorded(tmp_path):
    out = tmp_path / "profile.jsonl"
    assert main(["--jobs", "10", "--top", "5", "--worker-args", "--max-batch-jobs 4",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["worker_flags"] == "--max-batch-jobs 4"
    total, *functions = lines[1:]
    assert total["metric"] == "serve_profile_ms_per_job" and total["value"] > 0
    assert 5 <= len(functions) <= 10  # the top 5 by own time and by cumulative time
    assert all(r["metric"] == "serve_profile_function" for r in functions)
    own = [r["value"] for r in functions]
    assert own == sorted(own, reverse=True)
    stats = pstats.Stats(str(out.with_name(out.name + ".prof"))).stats
    steps = [v for (path, _, name), v in stats.items()
             if path.endswith("worker/step.py") and name == "run"]
    assert steps and steps[0][1] >= 3  # the worker's steps ran profiled: 10 jobs, 4 a step
