"""The prompts of one ``/v1/completions`` batch that share a prefix, prefilled once.

lm-eval's ``local-completions`` sends a multiple-choice question as one batch of token-id
prompts, context + each choice, with ``echo``, ``logprobs`` and ``max_tokens: 0``
(``lm_eval/models/openai_completions.py``). Such prompts become one job: the shared prefix
is its prompt and each prompt's rest a continuation (`model.continuations`), so the context
is prefilled once. Each prompt's answer is then rebuilt from that job's result as the
prompt's own job would give it: every position's logprob and top K (the prefix's from the
job's prompt logprobs, the rest from its continuation), within the chunked-vs-one-pass
bound of a job of its own (`tests/model/test_continuations.py`).

The one token ``max_tokens: 1`` generates is the argmax after each whole prompt, which each
continuation's ``top_k`` gives. Only token-id prompts are grouped: text prompts would need
the gateway to tokenize them to find their shared tokens, and a text prompt's tokens need
not be its prefix's followed by its rest's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..limits import Limits
from ..prefixes import BLOCK_TOKENS
from ..result import PrefillResult

# Prompts share a job when their first this many tokens agree (a prefix cache block's worth:
# a shorter shared prefix saves less than the pass it costs).
MIN_SHARED_TOKENS = BLOCK_TOKENS


@dataclass
class Job:
    """One job of a batch: `submit`'s input and the batch indices of the prompts it answers
    (one, or several sharing its prompt, each with a continuation in that order)."""

    input: dict[str, Any]
    members: list[int] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return "continuations" in self.input


def batch_jobs(inputs: Sequence[dict[str, Any]], limits: Limits) -> list[Job]:
    """The jobs that answer `inputs` (`submit` inputs, in batch order): one per prompt, but
    one for each group of token-id prompts whose first ``MIN_SHARED_TOKENS`` ids agree: its
    prompt is the group's longest common prefix (at most one token short of its shortest
    prompt) and each member's rest a continuation, within `limits`' continuations a job and
    their tokens together. Linear in the batch's tokens."""
    open_groups: dict[tuple[int, ...], _Group] = {}  # first ids -> a group being filled
    groups: list[_Group] = []
    for n, i in enumerate(inputs):
        ids = i.get("tokens")
        if ids is None or len(ids) <= MIN_SHARED_TOKENS:
            groups.append(_Group(n, None))
            continue
        key = tuple(ids[:MIN_SHARED_TOKENS])
        group = open_groups.get(key)
        if group is None or not group.add(n, ids, limits):
            group = open_groups[key] = _Group(n, ids)
            groups.append(group)
    jobs = []
    for group in groups:
        if len(group.members) == 1:
            jobs.append(Job(dict(inputs[group.members[0]]), group.members))
            continue
        prompts = [inputs[n]["tokens"] for n in group.members]
        context = prompts[0][: group.common]
        jobs.append(Job({"tokens": context,
                         "continuations": [p[group.common :] for p in prompts]},
                        group.members))
    return jobs


class _Group:
    """Prompts being gathered into one job: the batch indices, the first prompt's ids, the
    common prefix's length so far (one short of the shortest prompt at most) and the
    prompts' tokens together."""

    def __init__(self, n: int, ids: Sequence[int] | None):
        self.members, self.first = [n], ids
        self.common = 0 if ids is None else len(ids) - 1
        self.tokens = 0 if ids is None else len(ids)

    def add(self, n: int, ids: Sequence[int], limits: Limits) -> bool:
        """Take prompt `n` (`ids`) if the group then still makes one job within `limits`'
        continuations a job and their tokens together; whether it did."""
        common = min(self.common, len(ids) - 1)
        common = next((j for j in range(common) if ids[j] != self.first[j]), common)
        members, tokens = len(self.members) + 1, self.tokens + len(ids)
        if (members > limits.max_continuations
                or tokens - members * common > limits.max_continuation_tokens):
            return False
        self.members.append(n)
        self.common, self.tokens = common, tokens
        return True


def answers(jobs: Sequence[Job], results: Sequence[PrefillResult]) -> list[PrefillResult]:
    """Each prompt's result in batch order, from `jobs`' `results`: a shared job's as each
    member's own job would give it (`member_result`)."""
    out: dict[int, PrefillResult] = {}
    for job, result in zip(jobs, results, strict=True):
        if not job.shared:
            out[job.members[0]] = result
            continue
        for j, n in enumerate(job.members):
            out[n] = member_result(result, j)
    return [out[n] for n in range(len(out))]


def member_result(result: PrefillResult, j: int) -> PrefillResult:
    """The result prompt + continuation `j` of a shared job would have had alone: its
    length, its ``top_k`` (the continuation's), its prompt logprobs (the shared prompt's
    entries, then the continuation's, then the top K of its ``top_k``) and
    ``cached_tokens`` (continuation 0 carries what the job reused; each other one reused
    the whole shared prompt)."""
    continuation = result.continuations[j]
    n = result.n_tokens
    logprobs = None
    if result.prompt_logprobs is not None:
        k = len(result.prompt_logprobs[n]["top"])
        logprobs = [*result.prompt_logprobs[:n],
                    *({"token": t, "logprob": lp, "top": top} for t, lp, top in zip(
                        continuation.tokens, continuation.token_logprobs, continuation.top,
                        strict=True)),
                    {"token": None, "logprob": None,
                     "top": [{"id": t.id, "logprob": t.logprob} for t in continuation.top_k[:k]]}]
    return replace(result, n_tokens=n + len(continuation.tokens),
                   cached_tokens=result.cached_tokens if j == 0 else n,
                   top_k=continuation.top_k, prompt_logprobs=logprobs, continuations=None)
