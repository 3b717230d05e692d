"""`bench.system_prompt`: the workload's shape, and a short run end to end through a real
redis-server and real ``prefillq worker`` processes on the tiny Gemma 3 (the records' shape
and what holds whatever the machine: with the cache off nothing is reused; with it on every
job reuses the system prompt's whole blocks)."""

from __future__ import annotations

import json

from bench.system_prompt import USER_TOKENS, main, plan_jobs


def test_every_job_is_the_system_prompt_and_a_message_of_its_own():
    system, prompts = plan_jobs(10, 300, "gemma3-tiny", 0, seed=1)
    assert len(system) == 300 and system[0] == 2 and len(prompts) == 10
    assert all(p[:300] == system for p in prompts)
    assert all(USER_TOKENS[0] <= len(p) - 300 <= USER_TOKENS[1] for p in prompts)
    assert len({tuple(p) for p in prompts}) == 10
    assert plan_jobs(10, 300, "gemma3-tiny", 0, seed=1) == (system, prompts)


def test_the_cache_on_arm_reuses_the_system_prompt_in_every_job(tmp_path):
    out = tmp_path / "system.jsonl"
    assert main(["--jobs", "6", "--workers", "2", "--system-tokens", "100", "--json",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["workers"] == 2
    records = {(r["metric"], r.get("arm")): r for r in lines[1:]}
    off, on = records["system_prompt_mean_s", "off"], records["system_prompt_mean_s", "on"]
    assert off["prompt_tokens"] == on["prompt_tokens"]
    assert (off["hit_rate"], off["cached_tokens"], off["routed"]) == (0, 0, 0)
    # the warm-up job kept the system prompt's 3 whole blocks on one worker; a job that
    # lands on the other worker first runs cold there (and keeps them), so all but one hit
    assert on["hit_rate"] >= round(5 / 6, 4)  # the record rounds to 4 places
    assert on["cached_tokens"] >= 5 * 96
    assert 0 <= on["routed"] <= 6
    assert records["system_prompt_speedup", None]["value"] > 0
