"""`bench.prefix`: the workload's shape, and a short run end to end through a real
redis-server, real ``prefillq worker`` and ``prefillq serve`` processes on the tiny Gemma 3
(the records' shape and what must hold whatever the machine: the cache-on arm reuses every
context's blocks after its first choice, and its echoed logprobs equal cache off's)."""

from __future__ import annotations

import json

from bench.prefix import CHOICES, CONTEXT_TOKENS, CONTINUATION_TOKENS, main, plan_requests


def test_each_context_is_scored_with_four_continuations_in_order():
    prompts, context_lengths = plan_requests(5, "gemma3-tiny", 0, seed=1)
    assert len(prompts) == len(context_lengths) == 5 * CHOICES
    for c in range(5):
        group = prompts[c * CHOICES : (c + 1) * CHOICES]
        n = context_lengths[c * CHOICES]
        assert CONTEXT_TOKENS[0] <= n <= CONTEXT_TOKENS[1] and group[0][0] == 2
        assert all(p[:n] == group[0][:n] for p in group)
        assert all(CONTINUATION_TOKENS[0] <= len(p) - n <= CONTINUATION_TOKENS[1]
                   for p in group)
    assert plan_requests(5, "gemma3-tiny", 0, seed=1) == (prompts, context_lengths)


def test_the_cache_on_arm_reuses_the_contexts_with_cache_off_logprobs(tmp_path):
    out = tmp_path / "prefix.jsonl"
    assert main(["--contexts", "3", "--batch", "2", "--json", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["batch"] == 2
    records = {(r["metric"], r.get("arm")): r for r in lines[1:]}
    off, on = records["prefix_mc_wall_s", "off"], records["prefix_mc_wall_s", "on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] and off["cached_tokens"] == 0
    prompts, context_lengths = plan_requests(3, "gemma3-tiny", 0, seed=0)
    # two choices a request: the second of a context's first request waits for the first
    # to keep the context, then it and the next request's two reuse its whole blocks
    expected = sum(3 * (n // 32 * 32) for n in context_lengths[::CHOICES])
    assert on["cached_tokens"] == expected
    diff = records["prefix_mc_logprob_diff", None]
    assert diff["value"] <= 5e-6 and diff["greedy_mismatches"] == 0
