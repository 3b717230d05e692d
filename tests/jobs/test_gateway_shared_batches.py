"""`jobs.gateway.shared.batch_jobs`: which prompts of a ``/v1/completions`` batch share a
job, and each job's prompt and continuations, checked against the definition (the group's
longest common prefix, one short of its shortest prompt) within `Limits`."""

from __future__ import annotations

import random

from jobs.gateway.shared import MIN_SHARED_TOKENS, batch_jobs
from jobs.limits import Limits


def _lcp(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts) - 1
    return next((j for j in range(n) if len({p[j] for p in prompts}) > 1), n)


def _batch(seed: int) -> list[dict]:
    rng = random.Random(seed)
    contexts = [[rng.randrange(100) for _ in range(rng.randint(33, 60))] for _ in range(3)]
    batch = []
    for _ in range(20):
        kind = rng.random()
        if kind < 0.1:
            batch.append({"prompt": "text"})
        elif kind < 0.2:
            batch.append({"tokens": [rng.randrange(100) for _ in range(MIN_SHARED_TOKENS)]})
        else:
            context = rng.choice(contexts)
            batch.append({"tokens": context + [rng.randrange(100)
                                               for _ in range(rng.randint(0, 9))]})
    return batch


def test_every_prompt_is_answered_once_by_a_job_of_its_shared_prefix():
    for seed in range(20):
        batch = _batch(seed)
        jobs = batch_jobs(batch, Limits())
        assert sorted(n for job in jobs for n in job.members) == list(range(len(batch)))
        for job in jobs:
            if not job.shared:
                (n,) = job.members
                assert job.input == batch[n]
                continue
            prompts = [batch[n]["tokens"] for n in job.members]
            assert len({tuple(p[:MIN_SHARED_TOKENS]) for p in prompts}) == 1
            context = job.input["tokens"]
            assert context == prompts[0][: _lcp(prompts)]
            assert [context + c for c in job.input["continuations"]] == prompts
            assert all(len(c) >= 1 for c in job.input["continuations"])


def test_a_group_past_the_limits_starts_another_job():
    context = list(range(40))
    batch = [{"tokens": context + [1000 + i] * 3} for i in range(5)]
    two_each = batch_jobs(batch, Limits(max_continuations=2))
    assert [job.members for job in two_each] == [[0, 1], [2, 3], [4]]
    # 3 prompts share 40 tokens: 3 x 3 continuation tokens; a fourth would make 12
    tokens = batch_jobs(batch, Limits(max_continuation_tokens=10))
    assert [job.members for job in tokens] == [[0, 1, 2], [3, 4]]
