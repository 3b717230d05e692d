"""`bench.prefix`: the workload's shape, and a short run end to end through a real
redis-server, real ``prefillq worker`` and ``prefillq serve`` processes on the tiny Gemma 3
(the records' shape and what must hold whatever the machine: the choices of one request
share a job, the cache-on arm reuses every context's blocks after its first request, and its
echoed logprobs equal cache off's)."""

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


def _shared(a: list[int], b: list[int]) -> int:
    """The tokens two prompts of one request share as one job (`jobs.gateway.shared`)."""
    n = min(len(a), len(b)) - 1
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_the_cache_on_arm_reuses_the_contexts_with_cache_off_logprobs(tmp_path):
    out = tmp_path / "prefix.jsonl"
    assert main(["--contexts", "3", "--batch", "2", "--json", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["context"]["batch"] == 2
    records = {(r["metric"], r.get("arm"), r.get("over")): r for r in lines[1:]}
    off, on, separate = (records["prefix_mc_wall_s", arm, None]
                         for arm in ("off", "on", "separate"))
    assert off["prompt_tokens"] == on["prompt_tokens"] == separate["prompt_tokens"]
    prompts, _ = plan_requests(3, "gemma3-tiny", 0, seed=0)
    # two choices a request, one job: the second reuses the prefix the two share; with the
    # cache on, a context's second request also reuses the first's whole blocks
    shared = [_shared(prompts[i], prompts[i + 1]) for i in range(0, len(prompts), 2)]
    assert separate["cached_tokens"] == 0 and off["cached_tokens"] == sum(shared)
    held = sum(min(first // 32, (second - 1) // 32) * 32
               for first, second in zip(shared[::2], shared[1::2], strict=True))
    assert on["cached_tokens"] == sum(shared) + held
    diff = records["prefix_mc_logprob_diff", None, None]
    assert diff["value"] <= 5e-6 and diff["greedy_mismatches"] == 0
    assert records["prefix_mc_speedup", "on", "separate"]["value"] > 0
