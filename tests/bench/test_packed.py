"""`python -m bench.packed`: its prompts, its steps and the records it writes."""

from __future__ import annotations

import json

from bench import packed


def test_prompts_are_lm_eval_lengths_and_the_same_for_every_arm():
    first, again = packed.prompts(20, 262_144), packed.prompts(20, 262_144)
    assert first == again
    assert all(32 <= len(p) <= 512 and p[0] == 2 for p in first)


def test_the_records_rates_and_ratio_are_the_two_arms_timings(tiny, tmp_path):
    out = tmp_path / "packed.jsonl"
    assert packed.main(["--model", "gemma3-tiny", "--jobs", "5", "--batch", "3",
                        "--repeats", "1", "--json", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    context, one, both, ratio = lines
    assert context["context"]["jobs"] == 5 and context["context"]["batch"] == 3
    tokens = context["context"]["tokens"]
    for arm in (one, both):
        assert abs(arm["value"] - tokens / arm["seconds"]) <= 1e-2 * arm["value"]
    assert abs(ratio["value"] - one["seconds"] / both["seconds"]) < 0.01
